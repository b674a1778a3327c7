-- Give the claim up (bus/idempotency.py).
-- KEYS[1] the claim hash (see idempotency_claim.lua).
-- ARGV[1] token, ARGV[2] 'forget' (the run did nothing: the id is free) or 'expire' (the next
--   retry takes it over as a new attempt, and cleans up after this one).
-- Returns 0 if the claim is not ours.
if redis.call('HGET', KEYS[1], 't') ~= ARGV[1] then return 0 end
if ARGV[2] == 'forget' and redis.call('HGET', KEYS[1], 'a') == '0' then return redis.call('DEL', KEYS[1]) end
redis.call('HSET', KEYS[1], 'u', 0)
return 1
