-- The `apply` claim (services/broker/store.py, BrokerStore.claim): give the caller the oldest idle
-- resource of the first candidate broker that has one, in one step. Its own script, not a
-- `bus.cas` compare-and-set: it picks the resource inside Redis, and the records it rewrites are
-- named by the ids it pops (keys it cannot declare in advance; on a Redis Cluster this works only
-- because every broker key shares the declared keys' slot).
-- KEYS[1] the caller's record, KEYS[2] the index, KEYS[3] the brokers' version, KEYS[4] where the
-- request keeps its answer (as bus.cas's `once` step does), KEYS[5] the events outbox
-- (bus/outbox.py), then per candidate broker (in the user's order): its idle zset, sold set and
-- demand zset.
-- ARGV[1] the brokers' version the candidates were chosen at, ARGV[2] now, ARGV[3] key prefix of
-- the user's records, ARGV[4] the caller's index member, ARGV[5] a demand member, ARGV[6] the
-- request run's lease end (ms of server time; 0: no request claim, nothing fenced or kept),
-- ARGV[7] seconds the kept answer lives, ARGV[8] the outbox field of the sale's events, ARGV[9] a
-- placeholder for the sold resource's id (its prefix as long as the id is), ARGV[10 .. 9 +
-- candidates] per candidate the events of a sale by it, with the placeholder where the sold id
-- goes (the same length: the encoding holds),
-- then the caller record's fields (broker_resource_id and created_at are filled in here).
-- Returns {-3} (the run's lease ended: a retry may have taken it over), {-4, resource id} (an
-- earlier run of the request sold it), {-2} (stale brokers' version), {-1, status} (the caller is
-- launched already), {0} (every candidate's pool is empty) or {position from 1, resource id,
-- caller's new version, created_at}.
local fence = tonumber(ARGV[6])
if fence > 0 then
  local now = redis.call('TIME')
  if tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) >= fence then return {-3} end
  local kept = redis.call('HGET', KEYS[4], 'r')
  if kept then return {-4, kept} end
end
if (redis.call('GET', KEYS[3]) or '0') ~= ARGV[1] then return {-2} end
-- The caller may be new, released, or initialized and not launched; nothing else.
local status = redis.call('HGET', KEYS[1], 'status')
local live = status and status ~= 'released'
if live and (status ~= 'init' or redis.call('HGET', KEYS[1], 'launched') == '1') then return {-1, status} end
local version = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
local created = ARGV[2]
if live then created = redis.call('HGET', KEYS[1], 'created_at') end
local candidates = (#KEYS - 5) / 3
for b = 0, candidates - 1 do
  local idle, sold, demand = KEYS[6 + 3 * b], KEYS[7 + 3 * b], KEYS[8 + 3 * b]
  redis.call('ZADD', demand, ARGV[2], ARGV[5])
  while true do
    local oldest = redis.call('ZPOPMIN', idle)
    if #oldest == 0 then break end
    local id = oldest[1]
    local key = ARGV[3] .. id
    -- Pool membership and records change together, so this holds; checked all the same.
    if redis.call('HGET', key, 'status') == 'running' and redis.call('HGET', key, 'broker_sold') == '0' then
      redis.call('HSET', key, 'broker_sold', '1', 'updated_at', ARGV[2])
      redis.call('HINCRBY', key, 'version', 1)
      redis.call('SADD', sold, id)
      redis.call('DEL', KEYS[1])
      redis.call('HSET', KEYS[1], 'version', version + 1, 'broker_resource_id', id, 'created_at', created,
                 unpack(ARGV, 10 + candidates))
      redis.call('ZADD', KEYS[2], 'NX', created, ARGV[4])
      local template, placeholder = ARGV[10 + b], string.sub(ARGV[9], 1, #id)
      local at = string.find(template, placeholder, 1, true)
      while at do  -- every occurrence, as plain text
        template = string.sub(template, 1, at - 1) .. id .. string.sub(template, at + #id)
        at = string.find(template, placeholder, at + #id, true)
      end
      redis.call('HSET', KEYS[5], ARGV[8], template)
      if fence > 0 then
        redis.call('HSET', KEYS[4], 'r', id, 'v', version + 1)
        redis.call('EXPIRE', KEYS[4], ARGV[7])
      end
      return {b + 1, id, version + 1, created}
    end
  end
end
return {0}
