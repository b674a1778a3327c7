-- A node's record and its ledger in one step, so that they agree
-- (services/allocation/store.py, NodeStore.load_with_ledger).
-- KEYS[1] the node's record (hash), KEYS[2] its ledger (hash: workload id -> resources).
-- ARGV the workload ids to read from the ledger; none: all of it.
-- Returns {HGETALL of the record, HGETALL of the ledger or HMGET of the ids}.
-- function flags: no-writes
-- The ids are read a slice at a time: Lua's unpack takes at most about 8,000 values, and a
-- release may name 10,000 workloads of one node.
local ledger
if #ARGV == 0 then
  ledger = redis.call('HGETALL', KEYS[2])
else
  ledger = {}
  for first = 1, #ARGV, 1000 do
    for _, value in ipairs(redis.call('HMGET', KEYS[2], unpack(ARGV, first, math.min(first + 999, #ARGV)))) do
      ledger[#ledger + 1] = value
    end
  end
end
return {redis.call('HGETALL', KEYS[1]), ledger}
