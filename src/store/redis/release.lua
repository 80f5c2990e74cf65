-- release.lua: the entry point that gives back the slots of one lease (concurrency.lua) on one
-- key, when the work that held them ends. A lease already gone (expired, or given back) has
-- nothing to give back.
--
-- KEYS[1]: the key. ARGV[1]: the lease.
-- Returns the slots still in flight on the key.
local now_us = read_now('')
local lease = tonumber(ARGV[1])
local state = load_leases(KEYS[1])
local kept = {}
for _, held in ipairs(state.leases) do
  if held.id ~= lease then
    kept[#kept + 1] = held
  end
end
state.leases = kept
store_leases(KEYS[1], state, now_us)
local in_flight = 0
for _, held in ipairs(state.leases) do
  in_flight = in_flight + held.units
end
return in_flight
