-- Take a lease if it is free, or extend it if the holder holds it (bus/lease.py).
-- KEYS[1] the lease, a string: the holder; it expires with the lease.
-- ARGV[1] holder, ARGV[2] lease ms.
-- Returns 1 if the holder holds the lease now (for ARGV[2] ms from now), 0 if another one does.
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
