-- Keep the answer if we still hold the claim (bus/idempotency.py).
-- KEYS[1] the claim hash (see idempotency_claim.lua).
-- ARGV[1] token, ARGV[2] answer, ARGV[3] the idempotency window, s.
-- Returns 1 if kept, 0 if the claim was taken over.
if redis.call('HGET', KEYS[1], 't') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'r', ARGV[2])
redis.call('HDEL', KEYS[1], 't', 'u')
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
