-- release.lua: the entry point that gives back the slots of one lease (concurrency.lua) on one
-- key, when the work that held them ends. A lease already gone (expired, or given back) has
-- nothing to give back.
--
-- KEYS[1]: the key. ARGV[1]: the lease.
-- Returns the slots still in flight on the key.
local now_us = read_now('')
local lease = tonumber(ARGV[1])
local state = load_leases(KEYS[1])
state.leases = without_lease(state.leases, lease)
store_leases(KEYS[1], state, now_us)
return units_of(state.leases)
