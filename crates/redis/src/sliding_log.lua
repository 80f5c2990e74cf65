-- sliding_log.lua: the twin of crates/core/src/limit/sliding_log.rs, an exact log of the units admitted
-- within the last window. A call at t counts until t + window.
--
-- State: "sliding_log <at_us> <units> <at_us> <units> ...": the admitted calls still in the
-- window, oldest first, each at a whole epoch microsecond (it was a `now`); calls at the same
-- instant are merged. Reading and writing it is linear in its entries, like the memory twin's
-- retry walk, which is why this algorithm is for small limits.
-- A copy of the entries still in the window at now (the oldest aged out), for a refund to change.
local function entries_in_window(limiter, state, now_us)
  local window = limiter.span
  local entries = {}
  for _, entry in ipairs(state.entries) do
    if #entries > 0 or elapsed_ns(now_us, entry.at_us, window) < window then
      entries[#entries + 1] = { at_us = entry.at_us, units = entry.units }
    end
  end
  return entries
end

definitions.sliding_log = function()
  return {
    load = function(fields)
      if #fields % 2 ~= 0 then
        return nil
      end
      local entries = {}
      for i = 1, #fields, 2 do
        entries[#entries + 1] = { at_us = fields[i], units = fields[i + 1] }
      end
      return { entries = entries }
    end,

    save = function(state)
      local fields = {}
      for _, entry in ipairs(state.entries) do
        fields[#fields + 1] = entry.at_us
        fields[#fields + 1] = entry.units
      end
      return fields
    end,

    fresh = function()
      return { entries = {} }
    end,

    acquire = function(limiter, state, now_us, cost)
      local window = limiter.span
      -- Entries that still count at now: those after now - window (the oldest go first).
      local entries, total = {}, 0
      for _, entry in ipairs(state.entries) do
        if #entries > 0 or elapsed_ns(now_us, entry.at_us, window) < window then
          entries[#entries + 1] = { at_us = entry.at_us, units = entry.units }
          total = total + entry.units
        end
      end
      local allowed = total + cost <= limiter.capacity
      local charged = nil
      if allowed and cost > 0 then
        local last = entries[#entries]
        if last ~= nil and last.at_us >= now_us then
          last.units = last.units + cost
        else
          entries[#entries + 1] = { at_us = now_us, units = cost }
        end
        total = total + cost
        charged = { entries = entries }
      end
      local retry_after = 0
      if not allowed then
        -- Walk the oldest entries until enough units would have aged out.
        local freed = 0
        retry_after = window
        for _, entry in ipairs(entries) do
          freed = freed + entry.units
          retry_after = math.max((entry.at_us - now_us) * 1000 + window, 0)
          if total - freed + cost <= limiter.capacity then
            break
          end
        end
      end
      local reset_after = 0
      local last = entries[#entries]
      if last ~= nil then
        reset_after = math.max((last.at_us - now_us) * 1000 + window, 0)
      end
      return {
        allowed = allowed,
        limit = limiter.capacity,
        -- Saturating: a limit lowered under a live key must not go negative.
        remaining = math.max(limiter.capacity - total, 0),
        retry_after = retry_after,
        reset_after = reset_after,
      }, charged
    end,

    -- An operator's refund: the entries still in the window, less `units` taken from the newest.
    refund = function(limiter, state, now_us, units)
      local entries = entries_in_window(limiter, state, now_us)
      local left = units
      while left > 0 and #entries > 0 do
        local newest = entries[#entries]
        local taken = math.min(newest.units, left)
        newest.units, left = newest.units - taken, left - taken
        if newest.units == 0 then
          entries[#entries] = nil
        end
      end
      return { entries = entries }
    end,

    -- A settled price's refund: the units taken off the entry the charge was logged as (at its
    -- own instant), while it is still in the log; nothing off any other.
    give_back = function(limiter, state, now_us, units, taken_us)
      local entries = entries_in_window(limiter, state, now_us)
      for i, entry in ipairs(entries) do
        if entry.at_us == taken_us then
          entry.units = entry.units - math.min(entry.units, units)
          if entry.units == 0 then
            table.remove(entries, i)
          end
          break
        end
      end
      return { entries = entries }
    end,

    -- Forgotten when its newest entry ages out.
    forget_after = function(limiter, state, now_us)
      local last = state.entries[#state.entries]
      if last == nil then
        return 0
      end
      return (last.at_us - now_us) * 1000 + limiter.span
    end,
  }
end
