-- release.lua: the entry point that gives back the slots of one lease (concurrency.lua) on one
-- key, when the work that held them ends. A lease already gone (expired, or given back) has
-- nothing to give back.
--
-- The lease is replaced by a tombstone of 0 units that lasts a lease duration, so a renewal of
-- it already on its way (renew.lua) finds it given back instead of taking it again.
--
-- KEYS[1]: the key. ARGV[1]: the lease. ARGV[2]: the lease duration (us).
-- Returns the slots still in flight on the key.
local now_us = read_now('')
local lease = tonumber(ARGV[1])
local lease_us = tonumber(ARGV[2])
local state = load_leases(KEYS[1])
state.leases = without_lease(live_leases(state, now_us), lease)
state.leases[#state.leases + 1] = { id = lease, units = 0, expires_us = now_us + lease_us }
store_leases(KEYS[1], state, now_us)
return units_of(state.leases)
