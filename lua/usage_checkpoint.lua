-- tollgate usage history: one gateway's checkpoint, what it holds and has not yet added.
--
-- KEYS[1] the gateway's checkpoint (a string), KEYS[2] the registry (a sorted set:
--         gateway → when it last wrote, Redis' clock in ms); both in the {usage} slot
-- ARGV[1] the gateway's id    ARGV[2] '1' when it was noted in the registry before
-- ARGV[3] 'holds' (ARGV[4] is what it holds), 'empty' (it holds nothing), or 'same'
--         (unchanged: it is only noted alive)
--
-- A gateway noted before and not in the registry now was adopted: another took its
-- checkpoint aside (usage_adopt.lua) to add what it held. Nothing is written and it says
-- so: the gateway then adds those batches as they were, merges nothing more into them,
-- and writes again as a new one.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[2] == '1' and not redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  return 'adopted'
end
if ARGV[3] == 'holds' then
  redis.call('SET', KEYS[1], ARGV[4])
elseif ARGV[3] == 'empty' then
  redis.call('DEL', KEYS[1])
end
redis.call('ZADD', KEYS[2], now, ARGV[1])
return 'ok'
