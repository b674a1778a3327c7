-- Claim the durable timers that are due (services/broker/store.py, BrokerStore.claim_timers): they
-- are pushed to a later due time, so that if the claimer dies they fall due again.
-- KEYS[1] the timers, a zset: "<kind>|<user>|<id>" -> due time.
-- ARGV[1] now (timers due by then are claimed), ARGV[2] their new due time, ARGV[3] at most so many.
-- Returns the claimed members.
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, member in ipairs(due) do redis.call('ZADD', KEYS[1], ARGV[2], member) end
return due
