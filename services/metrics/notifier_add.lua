-- Add a notifier registration unless the node holds its most (services/metrics/notifier_store.py,
-- Registrations.add). Registering again under the same key (a retried request) rewrites it.
-- KEYS[1] the registration, a hash: ref, lease_ms; KEYS[2] the node's index of registrations (a set).
-- ARGV[1] the registration key, ARGV[2] ref, ARGV[3] lease in ms, ARGV[4] the most registrations,
-- ARGV[5] the prefix of a registration's hash key (as in notifier_live.lua).
-- Returns 1, or 0 when the node already holds ARGV[4] live registrations.
local index, key, most = KEYS[2], ARGV[1], tonumber(ARGV[4])
if redis.call('SISMEMBER', index, key) == 0 and redis.call('SCARD', index) >= most then
  -- Expired registrations stay in the index until someone looks: drop them before counting again.
  for _, held in ipairs(redis.call('SMEMBERS', index)) do
    if redis.call('EXISTS', ARGV[5] .. held) == 0 then redis.call('SREM', index, held) end
  end
  if redis.call('SCARD', index) >= most then return 0 end
end
redis.call('HSET', KEYS[1], 'ref', ARGV[2], 'lease_ms', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SADD', index, key)
return 1
