-- Take a node off the sweeper's list of leases, unless it was renewed since the sweeper read it.
-- KEYS[1] the list (a sorted set: node -> its lease's end in ms)
-- ARGV[1] the node, ARGV[2] the end the sweeper read
-- Returns 1 if it was taken off.
local ends = redis.call('ZSCORE', KEYS[1], ARGV[1])
if ends and tonumber(ends) <= tonumber(ARGV[2]) then
  return redis.call('ZREM', KEYS[1], ARGV[1])
end
return 0
