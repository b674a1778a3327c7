-- A node's record and its ledger in one step, so that they agree
-- (services/allocation/store.py, NodeStore.load_with_ledger).
-- KEYS[1] the node's record (hash), KEYS[2] its ledger (hash: workload id -> resources).
-- ARGV the workload ids to read from the ledger; none: all of it.
-- Returns {HGETALL of the record, HGETALL of the ledger or HMGET of the ids}.
local ledger
if #ARGV == 0 then ledger = redis.call('HGETALL', KEYS[2]) else ledger = redis.call('HMGET', KEYS[2], unpack(ARGV)) end
return {redis.call('HGETALL', KEYS[1]), ledger}
