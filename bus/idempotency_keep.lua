-- Keep the answer if we still hold the claim (bus/idempotency.py).
-- KEYS[1] the claim hash (see idempotency_claim.lua).
-- ARGV[1] token, ARGV[2] answer, ARGV[3] the idempotency window, s.
-- Returns 1 if kept, also when this very answer is kept already (a keep sent again because the
-- reply of the first was lost), 0 if the claim was taken over.
if redis.call('HGET', KEYS[1], 't') ~= ARGV[1] then
  if redis.call('HGET', KEYS[1], 'r') == ARGV[2] then return 1 end
  return 0
end
redis.call('HSET', KEYS[1], 'r', ARGV[2])
redis.call('HDEL', KEYS[1], 't', 'u')
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
