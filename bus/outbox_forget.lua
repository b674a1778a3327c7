-- Drop the pointer to an outbox that a sweep emptied, unless a newer commit moved it (bus/outbox.py).
-- KEYS[1] the pending sorted set (owner -> time of its last commit).
-- ARGV[1] the owner, ARGV[2] the score the sweep read.
-- Returns 1 if dropped.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then return redis.call('ZREM', KEYS[1], ARGV[1]) end
return 0
