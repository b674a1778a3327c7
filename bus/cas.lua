-- Compare-and-set of a versioned record hash, with guards and ops on other keys (bus/cas.py).
-- Checks the version the caller read, then every guard, and only then writes: the ops, then the
-- record with its version bumped. A stale version or a failed guard changes nothing.
--
-- KEYS[1] the record, a hash holding its version in field ARGV[1].
-- KEYS[2..] the other keys the guards and ops name, by position in KEYS (same hash slot on a cluster).
-- ARGV[1] the version field.
-- ARGV[2] the tombstone field, or '' for none: a record holding it does not exist (its version
--   reads as 0), but its stored version goes on counting when it is written again.
-- ARGV[3] the version the caller read (0: the record must not exist), optionally followed by
--   `:<tag read>:<new tag>`: the record's `tag` field must then be the one read ('' for none), and
--   the write sets the new one. A version alone does not name one write after a Redis failover:
--   the replica may lack the primary's last writes, and a new write can give a version again
--   that a reader had seen with other content; a random tag per write tells them apart.
-- ARGV[4] how the record is written:
--   'update'    set, then delete, the fields given; a tombstone comes back to life (its tombstone
--               field and its expiry go);
--   'replace'   the record becomes exactly the fields given;
--   'tombstone' only the version and the tombstone field (1) remain.
-- ARGV[5] seconds the record lives after the write (0: no expiry is set).
-- ARGV[6] n, then n items: field, value, ... to set on the record.
-- then m, then m record fields to delete ('update').
-- then the steps, up to the end: each a name, the position in KEYS of its key, then its arguments.
-- Guards are checked first, all of them, in order; then the ops are applied, in order:
--   guards  exists k | hexists k field | hnotexists k field | hequals k field value | hempty k |
--           fits k field add limit (hequals: the field holds value, '' for an absent field; fits:
--           the counter field, 0 if absent, plus add must not exceed limit)
--   ops     hset k field value | hdel k field | hcount k field n (add n; a counter that falls to 0
--           or below is removed) | sadd k member | srem k member | zadd k score member |
--           zrem k member | del k
--   both    hadd k field value (a guard, the field must not exist yet, and an op that sets it)
--           once k answer ttl (a guard, the key must not exist yet, and an op that makes it a hash
--           {r = answer, v = the record's new version} living ttl seconds: a request applied at
--           most once, its answer kept beside the record it changed)
--   op      journal k value (set field <the record's new version> of hash k to value: the events
--           of this change, in an outbox written in the same step as the change)
--   fence   before k ms (a guard: the server's time must be before ms, the end of the lease of the
--           run that writes; a run whose lease ran out may have been taken over, its write is refused)
--   leases  lapsed k field | live k field (guards: the hash field holds a time in ms, the end of a
--           lease, that the server's clock has reached (lapsed), or not yet (live); an absent field
--           fails both)
-- Returns {'ok', the new version}, {'version', the current version} or, for the first guard that
-- failed, {its name, its field (hexists, hnotexists, hequals, fits, hadd), key (exists), length (hempty),
-- the kept answer (once) or the server's time in ms (before, lapsed, live)}.
local record, version_field, tombstone, mode = KEYS[1], ARGV[1], ARGV[2], ARGV[4]
if mode ~= 'update' and mode ~= 'replace' and mode ~= 'tombstone' then
  return redis.error_reply('cas: unknown mode ' .. tostring(mode))
end
local stored = redis.call('HMGET', record, version_field, tombstone)
local counted = tonumber(stored[1] or '0')
local gone = tombstone ~= '' and stored[2]
local current = counted
if gone then current = 0 end
local expected, read_tag, new_tag = string.match(ARGV[3], '^(%d+):([^:]*):(.*)$')
if not expected then expected = ARGV[3] end
if current ~= tonumber(expected) then return {'version', tostring(current)} end
if read_tag and (redis.call('HGET', record, 'tag') or '') ~= read_tag then return {'version', tostring(current)} end

local i = 6
local function section()
  local n = tonumber(ARGV[i]); local first = i + 1; i = first + n
  return first, i - 1
end
local set_first, set_last = section()
local unset_first, unset_last = section()
local steps = i

-- How many ARGV items each step takes, its name included.
local size = {exists = 2, hexists = 3, hnotexists = 3, hequals = 4, hempty = 2, fits = 5, hset = 4, hdel = 3,
              hcount = 4, sadd = 3, srem = 3, zadd = 4, zrem = 3, del = 2, hadd = 4, once = 4, before = 3,
              journal = 3, lapsed = 3, live = 3}

local function server_ms()
  local now = redis.call('TIME')
  return tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end

local j = steps
while j <= #ARGV do
  local name, key = ARGV[j], KEYS[tonumber(ARGV[j + 1])]
  if not size[name] then return redis.error_reply('cas: unknown step ' .. tostring(name)) end
  if name == 'hadd' or name == 'hnotexists' then
    if redis.call('HEXISTS', key, ARGV[j + 2]) == 1 then return {name, ARGV[j + 2]} end
  elseif name == 'hexists' then
    if redis.call('HEXISTS', key, ARGV[j + 2]) == 0 then return {name, ARGV[j + 2]} end
  elseif name == 'hequals' then
    if (redis.call('HGET', key, ARGV[j + 2]) or '') ~= ARGV[j + 3] then return {name, ARGV[j + 2]} end
  elseif name == 'fits' then
    local held = tonumber(redis.call('HGET', key, ARGV[j + 2]) or '0')
    if held + tonumber(ARGV[j + 3]) > tonumber(ARGV[j + 4]) then return {name, ARGV[j + 2]} end
  elseif name == 'exists' then
    if redis.call('EXISTS', key) == 0 then return {name, key} end
  elseif name == 'hempty' then
    local held = redis.call('HLEN', key)
    if held > 0 then return {name, tostring(held)} end
  elseif name == 'once' then
    if redis.call('EXISTS', key) == 1 then return {name, redis.call('HGET', key, 'r') or ''} end
  elseif name == 'before' then
    local now = server_ms()
    if now >= tonumber(ARGV[j + 2]) then return {name, tostring(now)} end
  elseif name == 'lapsed' or name == 'live' then
    local now, ends = server_ms(), tonumber(redis.call('HGET', key, ARGV[j + 2]) or '')
    if not ends or (name == 'lapsed') ~= (now >= ends) then return {name, tostring(now)} end
  end
  j = j + size[name]
end

j = steps
while j <= #ARGV do
  local name, key = ARGV[j], KEYS[tonumber(ARGV[j + 1])]
  if name == 'hset' or name == 'hadd' then redis.call('HSET', key, ARGV[j + 2], ARGV[j + 3])
  elseif name == 'hdel' then redis.call('HDEL', key, ARGV[j + 2])
  elseif name == 'sadd' then redis.call('SADD', key, ARGV[j + 2])
  elseif name == 'srem' then redis.call('SREM', key, ARGV[j + 2])
  elseif name == 'zadd' then redis.call('ZADD', key, ARGV[j + 2], ARGV[j + 3])
  elseif name == 'zrem' then redis.call('ZREM', key, ARGV[j + 2])
  elseif name == 'hcount' then
    if redis.call('HINCRBY', key, ARGV[j + 2], ARGV[j + 3]) <= 0 then redis.call('HDEL', key, ARGV[j + 2]) end
  elseif name == 'del' then redis.call('DEL', key)
  elseif name == 'journal' then redis.call('HSET', key, counted + 1, ARGV[j + 2])
  elseif name == 'once' then
    redis.call('HSET', key, 'r', ARGV[j + 2], 'v', counted + 1)
    redis.call('EXPIRE', key, ARGV[j + 3])
  end
  j = j + size[name]
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
if new_tag and mode ~= 'tombstone' then redis.call('HSET', record, 'tag', new_tag) end
if tonumber(ARGV[5]) > 0 then redis.call('EXPIRE', record, ARGV[5]) end
return {'ok', tostring(after)}
