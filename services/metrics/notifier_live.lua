-- The live notifier registrations and their remaining lease; those that expired leave the index
-- (services/metrics/notifier_store.py, Registrations.live).
-- KEYS[1] the node's index of registrations, a set of registration keys.
-- ARGV[1] the prefix of a registration's hash key (the registration key follows it); the hashes
--   share KEYS[1]'s hash tag.
-- Returns {key, ms left, key, ms left, ...}.
local live = {}
for _, key in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local ttl = redis.call('PTTL', ARGV[1] .. key)
  if ttl > 0 then
    live[#live + 1] = key
    live[#live + 1] = ttl
  else
    redis.call('SREM', KEYS[1], key)
  end
end
return live
