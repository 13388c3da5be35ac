-- tollgate limits: every limit that applies to a request, decided at once, atomically.
-- A plan is a set of limits (token buckets and quotas); a client's state for all of them
-- lives in one hash, so one call (one slot in a cluster) decides them all: a request any
-- limit refuses spends from none.
--
-- KEYS[1] = the client's state, e.g. tollgate:b:{acme} (the hash tag keeps it in one slot)
-- ARGV[1] = 't': take `cost` for each of `n` requests that arrived together, in order;
--           'a': adjust every limit by `cost` (a debit, or a refund when negative) whatever
--                the balance: a cost reported after the response;
--           'p': peek (refill and reset, return the levels, write nothing).
-- ARGV[2] = cost (tokens), ARGV[3] = n (requests; 't' only)
-- ARGV[4] = '1' when the hash holds limits besides these (limits of other services): its
--           expiry then only ever grows, so theirs is never cut short; '' otherwise.
-- Then six arguments per limit: its field prefix ('' or 'name:'), its kind, and four values:
--   'b' bucket:  capacity, rate (tokens/s), the tokens a bucket that does not exist yet
--                starts with ('' = full: used when a client moves between its global
--                bucket and regional shards), unused;
--   'q' quota on calendar or anchor windows: amount, then the ends (unix µs) of the
--                previous, current and next windows around the gateway's clock: Redis'
--                own clock picks among them, so gateway clocks never matter;
--   'r' rolling quota: amount, the window's length (µs) if one started now, unused x2.
--
-- The time comes from Redis itself (TIME). The arithmetic is src/domain/limits.rs's
-- (`Level::at`, then `take_many` / `Level::adjust`), operation for operation, so the
-- embedded store decides identically and the gateway replays the takes to give each
-- request its own answer.
--
-- Returns { requests admitted, now (µs), then two strings per limit, before any take:
-- a bucket's tokens after refilling and ''; a quota's count and its window's end }.

local op = ARGV[1]
local cost = tonumber(ARGV[2])
local n = tonumber(ARGV[3]) or 1
local others = ARGV[4] == '1'
local count = (#ARGV - 4) / 6

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local nowstr = t[1] .. string.format('%06d', tonumber(t[2]))

local names = {}
for i = 1, count do
  local f = ARGV[4 + (i - 1) * 6 + 1]
  if ARGV[4 + (i - 1) * 6 + 2] == 'b' then
    names[2 * i - 1], names[2 * i] = f .. 'tk', f .. 'ts'
  else
    names[2 * i - 1], names[2 * i] = f .. 'n', f .. 'e'
  end
end
local s = redis.call('HMGET', KEYS[1], unpack(names))

-- Levels now: buckets refilled, quotas reset when their window is over.
local kind, a, b, lv, en = {}, {}, {}, {}, {}
for i = 1, count do
  local base = 4 + (i - 1) * 6
  kind[i] = ARGV[base + 2]
  a[i] = tonumber(ARGV[base + 3])
  local s1, s2 = tonumber(s[2 * i - 1]), tonumber(s[2 * i])
  if kind[i] == 'b' then
    b[i] = tonumber(ARGV[base + 4])
    local tokens = s1 or math.min(a[i], tonumber(ARGV[base + 5]) or a[i])
    local elapsed = now - (s2 or now)
    if elapsed < 0 then elapsed = 0 end
    lv[i] = math.min(a[i], tokens + elapsed * b[i] / 1000000)
  elseif s1 and s2 and now < s2 then
    lv[i], en[i] = s1, s2
  else
    lv[i] = 0
    if kind[i] == 'r' then
      en[i] = now + tonumber(ARGV[base + 4])
    else
      local e0, e1 = tonumber(ARGV[base + 4]), tonumber(ARGV[base + 5])
      if now < e0 then en[i] = e0 elseif now < e1 then en[i] = e1 else en[i] = tonumber(ARGV[base + 6]) end
    end
  end
end

local reply = { '0', nowstr }
for i = 1, count do
  reply[1 + 2 * i] = string.format('%.17g', lv[i])
  reply[2 + 2 * i] = kind[i] == 'b' and '' or string.format('%.0f', en[i])
end
if op == 'p' then return reply end

local admitted = 0
if op == 't' then
  -- Once one request is refused the rest are too: they all cost the same.
  local fits = true
  while fits and admitted < n do
    for i = 1, count do
      if kind[i] == 'b' then
        if lv[i] < cost then fits = false end
      elseif lv[i] + cost > a[i] then
        fits = false
      end
    end
    if fits then
      for i = 1, count do
        if kind[i] == 'b' then lv[i] = lv[i] - cost else lv[i] = lv[i] + cost end
      end
      admitted = admitted + 1
    end
  end
else
  -- A bucket may go below zero (down to minus the largest capacity) and wait it off; a
  -- quota's count never goes below zero.
  for i = 1, count do
    if kind[i] == 'b' then
      lv[i] = math.max(-1e9, math.min(a[i], lv[i] - cost))
    else
      lv[i] = math.max(0, math.min(2 * a[i], lv[i] + cost))
    end
  end
end
reply[1] = tostring(admitted)

-- %.17g keeps every bit of the double; TIME's parts keep the timestamp exact. The state is
-- kept until the last of its limits is whole again (a bucket full, a quota's window over,
-- +1 s of slack), never shortened by a request that some limits did not apply to.
local out, keep = {}, 0
for i = 1, count do
  local f = names[2 * i - 1]
  local k
  if kind[i] == 'b' then
    out[#out + 1] = f; out[#out + 1] = string.format('%.17g', lv[i])
    out[#out + 1] = names[2 * i]; out[#out + 1] = nowstr
    k = math.ceil((a[i] - lv[i]) / b[i] * 1000) + 1000
  else
    out[#out + 1] = f; out[#out + 1] = string.format('%.17g', lv[i])
    out[#out + 1] = names[2 * i]; out[#out + 1] = string.format('%.0f', en[i])
    k = math.ceil((en[i] - now) / 1000) + 1000
  end
  if k > keep then keep = k end
end
redis.call('HSET', KEYS[1], unpack(out))
if not others or redis.call('PTTL', KEYS[1]) < keep then
  redis.call('PEXPIRE', KEYS[1], keep)
end
return reply
