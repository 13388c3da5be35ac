-- tollgate usage history: a gateway whose checkpoint is for another to add.
--
-- KEYS[1] the registry (gateway → when it last wrote, ms), KEYS[2] the adoptions
--         (gateway → when its checkpoint was adopted, ms); both in the {usage} slot
-- ARGV[1] the grace, ms
--
-- Returns one gateway whose adopter has been silent past the grace (it died before it
-- released the checkpoint), else one silent itself past the grace, else false.

local t = redis.call('TIME')
local cutoff = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - tonumber(ARGV[1])
local late = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', cutoff, 'LIMIT', 0, 1)
if late[1] then
  return late[1]
end
local silent = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff, 'LIMIT', 0, 1)
return silent[1] or false
