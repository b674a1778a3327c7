-- Extend our claim's lease (bus/idempotency.py).
-- KEYS[1] the claim hash (see idempotency_claim.lua).
-- ARGV[1] token, ARGV[2] lease ms.
-- Returns the new lease end (ms of server time), or 0 if the claim is not ours: it was taken over,
-- or its answer was kept.
if redis.call('HGET', KEYS[1], 't') ~= ARGV[1] then return 0 end
local now = redis.call('TIME')
local ends = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'u', ends)
return ends
