-- loop_answer.lua: the entry point that hears the answer a checked call got (loop_history.lua,
-- mode "answer"), as LoopDetector::answered does: the call's earlier repetitions stop counting
-- if the answer changed, and the tool's identical answers are counted and, at no_progress, the
-- tool is stopped.
--
-- KEYS[1]: the caller's loop history.
-- ARGV[1]: now in epoch microseconds, or "" to use Redis's TIME.
-- ARGV[2], ARGV[3]: the window (us) and repeats.
-- ARGV[4]: "<signature> <tool signature> <answer> <no_progress>".
-- Returns {same, stopped_for_us}.

if redis.replicate_commands then
  redis.replicate_commands()
end

local now_us = read_now(ARGV[1])
return loop_history(KEYS[1], now_us, 'answer', tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4])
