-- Give a lease up, if the holder holds it (bus/lease.py).
-- KEYS[1] the lease (see lease_hold.lua).
-- ARGV[1] holder.
-- Returns 1 if it was released, 0 if the holder did not hold it (then nothing changes).
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
