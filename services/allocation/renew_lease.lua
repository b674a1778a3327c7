-- Renew a node's lease (its agent's heartbeat), without touching the node's record or version.
-- KEYS[1] the node's record (a hash; absent, or holding `gone`, for a node that does not exist)
-- KEYS[2] the node's lease (a hash)
-- ARGV[1] the lease's length in ms
-- ARGV[2] what the agent reports of itself (opaque bytes, shown by list-nodes)
-- Returns {0} for a node that does not exist (nothing is written), else {1, the node's status ('' for
-- up), the lease's new end, the server's time} (times in ms of the server's clock, which every
-- worker shares: the agents' clocks never decide when a lease ends).
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'gone') == 1 then
  return {0}
end
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local ends = now + tonumber(ARGV[1])
redis.call('HSET', KEYS[2], 'ends', ends, 'beat', now, 'ttl', ARGV[1], 'agent', ARGV[2])
return {1, redis.call('HGET', KEYS[1], 'status') or '', ends, now}
