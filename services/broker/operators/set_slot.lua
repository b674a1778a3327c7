-- Set one instance's slot if it is still as its launcher last saw it
-- (services/broker/operators/process_store.py, ProcessTable.set_slot). Two launches of one
-- resource can overlap (one paused past its launch lease, and the one that took it over): an
-- instance's intent and its process are recorded only over what the launcher started from, so one
-- of them keeps the instance and the other stops what it started.
-- KEYS[1] the resource's hash of slots, KEYS[2] the set of every instance.
-- ARGV[1] the instance index, ARGV[2] its member in KEYS[2], ARGV[3] the slot as the launcher saw
-- it ('' for none), ARGV[4] the new slot.
-- Returns the slot as it is now: ARGV[4] when set, else what is there instead (false for none).
local current = redis.call('HGET', KEYS[1], ARGV[1])
if (current or '') ~= ARGV[3] then return current end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[4])
redis.call('SADD', KEYS[2], ARGV[2])
return ARGV[4]
