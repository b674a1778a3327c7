-- Claim a request id, or find its kept answer (bus/idempotency.py).
-- Its own script, not a `bus/lease` lease: the claim lives inside the hash that keeps the answer
-- for the idempotency window (a lease on the key's TTL would take the answer with it), it is timed by the server's
-- clock in a field, and it also checks the payload's digest and counts the runs.
-- KEYS[1] the claim, a hash: d (payload digest), t (holder's token), u (lease end, ms of server
--   time), a (runs so far), r (the kept answer).
-- ARGV[1] payload digest, ARGV[2] token, ARGV[3] lease ms, ARGV[4] the idempotency window, s.
-- Returns {'claimed', attempt, lease end} | {'done', answer} | {'busy', ms left} | {'mismatch', ''}.
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local held = redis.call('HMGET', KEYS[1], 'd', 'r', 'u', 'a')
if not held[1] then
  redis.call('HSET', KEYS[1], 'd', ARGV[1], 't', ARGV[2], 'u', now + tonumber(ARGV[3]), 'a', 0)
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  return {'claimed', '0', tostring(now + tonumber(ARGV[3]))}
end
if held[1] ~= ARGV[1] then return {'mismatch', ''} end
if held[2] then return {'done', held[2]} end
local left = tonumber(held[3] or '0') - now
if left > 0 then return {'busy', tostring(left)} end
local attempt = tonumber(held[4] or '0') + 1
redis.call('HSET', KEYS[1], 't', ARGV[2], 'u', now + tonumber(ARGV[3]), 'a', attempt)
return {'claimed', tostring(attempt), tostring(now + tonumber(ARGV[3]))}
