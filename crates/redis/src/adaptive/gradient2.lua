-- adaptive/gradient2.lua: the twin of crates/core/src/limit/adaptive/gradient2.rs, Netflix's latency
-- gradient. The long-term RTT is the average of the first ten answers that took measurable time,
-- then an exponential average over long_window; the limit moves by tolerance x long / rtt (kept within 0.5 and 1)
-- plus queue_size, smoothed, unless less than half of it is in use.
learners.gradient2 = function(learner, learnt, rtt, others)
  -- An answer that took no measurable time says nothing of latency: gradient 1, no queue.
  local gradient = 1
  if rtt > 0 then
    if learnt.samples < 10 then
      learnt.samples = learnt.samples + 1
      learnt.long_rtt = learnt.long_rtt + (rtt - learnt.long_rtt) / learnt.samples
    else
      local factor = 2 / (learner.long_window + 1)
      learnt.long_rtt = learnt.long_rtt * (1 - factor) + rtt * factor
    end
    local long_rtt = learnt.long_rtt
    if long_rtt / rtt > 2 then
      learnt.long_rtt = long_rtt * 0.95
    end
    gradient = math.max(0.5, math.min(1, learner.tolerance * long_rtt / rtt))
  end
  if others + 1 < learnt.limit / 2 then
    return
  end
  local new = learnt.limit * gradient + learner.queue_size
  learnt.limit = learnt.limit * (1 - learner.smoothing) + new * learner.smoothing
end
