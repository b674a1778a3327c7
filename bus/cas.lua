-- Compare-and-set of a versioned record hash, with guards and ops on other keys (bus/cas.py).
-- Checks the version the caller read, then every guard, and only then writes: the ops, then the
-- record with its version bumped. A stale version or a failed guard changes nothing.
--
-- KEYS[1] the record, a hash holding its version in field ARGV[1].
-- KEYS[2..] the other keys the guards and ops name, by position in KEYS (same hash slot on a cluster).
-- ARGV[1] the version field.
-- ARGV[2] the tombstone field, or '' for none: a record holding it does not exist (its version
--   reads as 0), but its stored version goes on counting when it is written again.
-- ARGV[3] the version the caller read (0: the record must not exist).
-- ARGV[4] how the record is written:
--   'update'    set, then delete, the fields given; a tombstone comes back to life (its tombstone
--               field and its expiry go);
--   'replace'   the record becomes exactly the fields given;
--   'tombstone' only the version and the tombstone field (1) remain.
-- ARGV[5] seconds the record lives after the write (0: no expiry is set).
-- ARGV[6] n, then n items: field, value, ... to set on the record.
-- then m, then m record fields to delete ('update').
-- then g, then g items of guards; then ops up to the end. Each is a name, the key's position in
-- KEYS, then its arguments:
--   guards  exists k | hexists k field | hnotexists k field | hempty k | fits k field add limit
--           (fits: the counter field, 0 if absent, plus add must not exceed limit)
--   ops     hset k field value | hdel k field | hcount k field n (add n; a counter that falls to 0
--           or below is removed) | sadd k member | srem k member | zadd k score member |
--           zrem k member | del k
-- Returns {'ok', the new version}, {'version', the current version} or, for the first guard that
-- failed, {its name, its field (hexists, hnotexists, fits), key (exists) or length (hempty)}.
local record, version_field, tombstone, mode = KEYS[1], ARGV[1], ARGV[2], ARGV[4]
if mode ~= 'update' and mode ~= 'replace' and mode ~= 'tombstone' then
  return redis.error_reply('cas: unknown mode ' .. tostring(mode))
end
local stored = redis.call('HMGET', record, version_field, tombstone)
local counted = tonumber(stored[1] or '0')
local gone = tombstone ~= '' and stored[2]
local current = counted
if gone then current = 0 end
if current ~= tonumber(ARGV[3]) then return {'version', tostring(current)} end

local i = 6
local function section()
  local n = tonumber(ARGV[i]); local first = i + 1; i = first + n
  return first, i - 1
end
local set_first, set_last = section()
local unset_first, unset_last = section()
local guard_first, guard_last = section()

local j = guard_first
while j <= guard_last do
  local name, key = ARGV[j], KEYS[tonumber(ARGV[j + 1])]
  if name == 'hnotexists' then
    if redis.call('HEXISTS', key, ARGV[j + 2]) == 1 then return {name, ARGV[j + 2]} end
    j = j + 3
  elseif name == 'hexists' then
    if redis.call('HEXISTS', key, ARGV[j + 2]) == 0 then return {name, ARGV[j + 2]} end
    j = j + 3
  elseif name == 'fits' then
    local held = tonumber(redis.call('HGET', key, ARGV[j + 2]) or '0')
    if held + tonumber(ARGV[j + 3]) > tonumber(ARGV[j + 4]) then return {name, ARGV[j + 2]} end
    j = j + 5
  elseif name == 'exists' then
    if redis.call('EXISTS', key) == 0 then return {name, key} end
    j = j + 2
  elseif name == 'hempty' then
    local held = redis.call('HLEN', key)
    if held > 0 then return {name, tostring(held)} end
    j = j + 2
  else
    return redis.error_reply('cas: unknown guard ' .. tostring(name))
  end
end

while i <= #ARGV do
  local name, key = ARGV[i], KEYS[tonumber(ARGV[i + 1])]
  if name == 'hset' then redis.call('HSET', key, ARGV[i + 2], ARGV[i + 3]); i = i + 4
  elseif name == 'hdel' then redis.call('HDEL', key, ARGV[i + 2]); i = i + 3
  elseif name == 'sadd' then redis.call('SADD', key, ARGV[i + 2]); i = i + 3
  elseif name == 'srem' then redis.call('SREM', key, ARGV[i + 2]); i = i + 3
  elseif name == 'zadd' then redis.call('ZADD', key, ARGV[i + 2], ARGV[i + 3]); i = i + 4
  elseif name == 'zrem' then redis.call('ZREM', key, ARGV[i + 2]); i = i + 3
  elseif name == 'hcount' then
    if redis.call('HINCRBY', key, ARGV[i + 2], ARGV[i + 3]) <= 0 then redis.call('HDEL', key, ARGV[i + 2]) end
    i = i + 4
  elseif name == 'del' then redis.call('DEL', key); i = i + 2
  else
    return redis.error_reply('cas: unknown op ' .. tostring(name))
  end
end

local after = counted + 1
if mode == 'update' then
  if gone then
    redis.call('HDEL', record, tombstone)
    redis.call('PERSIST', record)
  end
  redis.call('HSET', record, version_field, after, unpack(ARGV, set_first, set_last))
  if unset_last >= unset_first then redis.call('HDEL', record, unpack(ARGV, unset_first, unset_last)) end
elseif mode == 'replace' then
  redis.call('DEL', record)
  redis.call('HSET', record, version_field, after, unpack(ARGV, set_first, set_last))
else  -- 'tombstone'
  redis.call('DEL', record)
  redis.call('HSET', record, version_field, after, tombstone, 1)
end
if tonumber(ARGV[5]) > 0 then redis.call('EXPIRE', record, ARGV[5]) end
return {'ok', tostring(after)}
