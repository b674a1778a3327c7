-- Remove a notifier registration (services/metrics/notifier_store.py, Registrations.remove), and
-- under a request id keep whether it was there, in the same step: a retry whose first run removed
-- it and died before answering must answer what that run found, not "it was not registered".
-- KEYS[1] the registration, a hash.
-- KEYS[2] the node's index of registrations, a set of registration keys.
-- KEYS[3] (only under a request id) where the request's answer is kept; same hash tag as the others.
-- ARGV[1] the registration key (its member in KEYS[2]).
-- ARGV[2] (with KEYS[3]) seconds the answer is kept.
-- Returns 1 if this request removed the registration, else 0.
if KEYS[3] then
  local kept = redis.call('GET', KEYS[3])
  if kept then return tonumber(kept) end
end
local removed = redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
if KEYS[3] then redis.call('SET', KEYS[3], removed, 'EX', ARGV[2]) end
return removed
