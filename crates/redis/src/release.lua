-- release.lua: the entry point that gives back the slots of one lease (concurrency.lua) on one
-- key, when the work that held them ends. A lease already gone (expired, or given back) has
-- nothing to give back.
--
-- The lease is replaced by a tombstone of 0 units that lasts a lease duration, so a renewal of
-- it already on its way (renew.lua) finds it given back instead of taking it again.
--
-- When ARGV[3] names a channel, a release that gave slots back says so there (PUBLISH, the key as
-- the message), in the same step: an instance waiting for one of the key's slots hears it only
-- once the slot is free, and asks for it at once instead of a second later.
--
-- KEYS[1]: the key. ARGV[1]: the lease. ARGV[2]: the lease duration (us). ARGV[3]: a channel, or
-- none.
-- Returns the slots still in flight on the key.
local now_us = read_now('')
local lease = tonumber(ARGV[1])
local lease_us = tonumber(ARGV[2])
local state = load_leases(KEYS[1])
local live = live_leases(state, now_us)
local freed = units_of(live) - units_of(without_lease(live, lease))
state.leases = without_lease(live, lease)
state.leases[#state.leases + 1] = { id = lease, units = 0, expires_us = now_us + lease_us }
store_leases(KEYS[1], state, now_us)
if ARGV[3] and freed > 0 then
  redis.call('PUBLISH', ARGV[3], KEYS[1])
end
return units_of(state.leases)
