-- A node's record, its ledger and the ledger's owners in one step, so that they agree
-- (services/allocation/store.py, NodeStore.load_with_ledger).
-- KEYS[1] the node's record (hash), KEYS[2] its ledger (hash: workload id -> resources), KEYS[3]
-- the ledger's owners (hash: workload id -> identity).
-- ARGV the workload ids to read from the ledger and the owners; none: all of them.
-- Returns {HGETALL of the record, HGETALL of the ledger or HMGET of the ids, the same of the owners}.
-- function flags: no-writes
-- The ids are read a slice at a time: Lua's unpack takes at most about 8,000 values, and a
-- release may name 10,000 workloads of one node.
local function read(key)
  if #ARGV == 0 then return redis.call('HGETALL', key) end
  local values = {}
  for first = 1, #ARGV, 1000 do
    for _, value in ipairs(redis.call('HMGET', key, unpack(ARGV, first, math.min(first + 999, #ARGV)))) do
      values[#values + 1] = value
    end
  end
  return values
end
return {redis.call('HGETALL', KEYS[1]), read(KEYS[2]), read(KEYS[3])}
