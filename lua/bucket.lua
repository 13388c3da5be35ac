-- tollgate limits: every limit that applies to a request, decided at once, atomically, for
-- the requests of many clients in one call.
--
-- A plan is a set of limits (token buckets and quotas); a client's state for all of them
-- lives in one hash, so one entry decides them all: a request any limit refuses spends
-- from none. A call carries one entry per KEY: a worker sends the entries that queued up
-- during one turn of its event loop together, so Redis pays its per-call cost once for
-- them all (on a cluster, only entries whose keys share a slot travel together). Entries
-- are decided in order: a key may appear twice, and the second entry sees the first's.
--
-- KEYS[k] = a client's state, e.g. tollgate:b:{acme} (the hash tag keeps it in one slot).
-- ARGV[1] = m, then m more keys: on a cluster a call declares only its first key (which
-- routes it to its master) and passes the other keys of that master here; a key that is
-- not the node's (its slot moved) fails its own entry only. The entries' keys are KEYS,
-- then these.
-- Then the number of limit sets; then each set: its number of limits, and six
-- arguments per limit: its field prefix ('' or 'name:'), its kind, and four values:
--   'b' bucket:  capacity, rate (tokens/s), the tokens a bucket that does not exist yet
--                starts with ('' = full: used when a client moves between its global
--                bucket and regional shards), unused;
--   'q' quota on calendar or anchor windows: amount, then the ends (unix µs) of the
--                previous, current and next windows around the gateway's clock: Redis'
--                own clock picks among them, so gateway clocks never matter;
--   'r' rolling quota: amount, the window's length (µs) if one started now, unused x2.
-- Then four arguments per entry (per KEY), in order:
--   op: 't': take `cost` for each of `n` requests that arrived together, in order;
--       'a': adjust every limit by `cost` (a debit, or a refund when negative) whatever
--            the balance: a cost reported after the response;
--       'p': peek (refill and reset, return the levels, write nothing);
--   cost (tokens); n (requests; 't' only); the entry's limit set (1-based).
-- A batch of clients on the same plan shares one set: an entry is four short arguments.
--
-- The time comes from Redis itself (TIME), once per call. The arithmetic is
-- src/domain/limits.rs's (`Level::at`, then `take_many` / `Level::adjust`), operation for
-- operation, so the embedded store decides identically and the gateway replays the takes
-- to give each request its own answer.
--
-- Returns { now (µs, decimal), a status per entry ('1' decided, '0' failed: its string
-- is then the error), then one binary string per entry: struct '<I' requests
-- admitted, then per limit two little-endian doubles, before any take: a bucket's tokens
-- after refilling and 0; a quota's count and its window's end (µs) }. Binary keeps every
-- bit of a double without formatting it; formatting doubles was a third of the script's
-- cost.
--
-- State is written in decimal (whole numbers as integers, others with 17 digits: every
-- bit of the double). The hash lives until the last of its limits is whole again (a
-- bucket full, a quota's window over, +1 s of slack); its expiry is set to twice that and
-- noted in field 'x' (unix ms), and set again only when a write needs more than 'x' has:
-- most writes need no PEXPIRE, and an expiry is never shortened (limits of other services
-- in the same hash keep theirs).

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local nowstr = t[1] .. string.format('%06d', tonumber(t[2]))
local nowms = math.floor(now / 1000)
local floor, min, max, format = math.floor, math.min, math.max, string.format

-- Exact decimal: whole numbers as integers (cheap), others with every bit.
local function dec(v)
  if v == floor(v) and v > -1e15 and v < 1e15 then return format('%d', v) end
  return format('%.17g', v)
end

local keys, m = KEYS, tonumber(ARGV[1])
if m > 0 then
  keys = {}
  for k = 1, #KEYS do keys[k] = KEYS[k] end
  for k = 1, m do keys[#KEYS + k] = ARGV[1 + k] end
end

-- The limit sets.
local sets = {}
local at = 2 + m
for s = 1, tonumber(ARGV[at]) do
  local count = tonumber(ARGV[at + 1])
  if count == 1 and ARGV[at + 3] == 'b' then
    -- One bucket, the commonest plan: decided by `one` below.
    local f = ARGV[at + 2]
    sets[s] = { one = true, tk = f .. 'tk', ts = f .. 'ts', cap = tonumber(ARGV[at + 4]),
      rate = tonumber(ARGV[at + 5]), init = tonumber(ARGV[at + 6]) }
  else
    local set = { count = count, kind = {}, a = {}, v1 = {}, v2 = {}, v3 = {}, read = {},
      field = {}, fmt = '<I' .. string.rep('d', 2 * count) }
    for i = 1, count do
      local base = at + 1 + (i - 1) * 6
      local f, k = ARGV[base + 1], ARGV[base + 2]
      set.kind[i], set.a[i] = k, tonumber(ARGV[base + 3])
      set.v1[i], set.v2[i], set.v3[i] =
        tonumber(ARGV[base + 4]), tonumber(ARGV[base + 5]), tonumber(ARGV[base + 6])
      if k == 'b' then
        set.field[2 * i - 1], set.field[2 * i] = f .. 'tk', f .. 'ts'
      else
        set.field[2 * i - 1], set.field[2 * i] = f .. 'n', f .. 'e'
      end
      set.read[2 * i - 1], set.read[2 * i] = set.field[2 * i - 1], set.field[2 * i]
    end
    set.read[2 * count + 1] = 'x'
    sets[s] = set
  end
  at = at + 1 + 6 * count
end

local reply, status = { nowstr, '' }, {}

-- The entry of a set of one bucket: the general case below, with its loops unrolled.
local function one(key, set, op, cost, n)
  local cap, rate = set.cap, set.rate
  local s = redis.call('HMGET', key, set.tk, set.ts, 'x')
  local lv = tonumber(s[1]) or min(cap, set.init or cap)
  local elapsed = now - (tonumber(s[2]) or now)
  if elapsed < 0 then elapsed = 0 end
  lv = min(cap, lv + elapsed * rate / 1000000)
  local before, admitted = lv, 0
  if op == 't' then
    while admitted < n and lv >= cost do
      lv = lv - cost
      admitted = admitted + 1
    end
  elseif op == 'a' then
    lv = max(-1e9, min(cap, lv - cost))
  end
  local r = struct.pack('<Idd', admitted, before, 0)
  if op == 'p' then return r end
  local keep = math.ceil((cap - lv) / rate * 1000) + 1000
  local x = tonumber(s[3])
  if x and x >= nowms + keep then
    redis.call('HSET', key, set.tk, dec(lv), set.ts, nowstr)
  else
    redis.call('HSET', key, set.tk, dec(lv), set.ts, nowstr, 'x', format('%d', nowms + 2 * keep))
    redis.call('PEXPIRE', key, 2 * keep)
  end
  return r
end

-- Reused by every entry.
local lv, en, packed, out = {}, {}, {}, {}

-- The entry of any other set.
local function many(key, set, op, cost, n)
  local count, kind, a = set.count, set.kind, set.a
  local s = redis.call('HMGET', key, unpack(set.read))

  -- Levels now: buckets refilled, quotas reset when their window is over.
  for i = 1, count do
    local s1, s2 = tonumber(s[2 * i - 1]), tonumber(s[2 * i])
    en[i] = 0
    if kind[i] == 'b' then
      local tokens = s1 or min(a[i], set.v2[i] or a[i])
      local elapsed = now - (s2 or now)
      if elapsed < 0 then elapsed = 0 end
      lv[i] = min(a[i], tokens + elapsed * set.v1[i] / 1000000)
    elseif s1 and s2 and now < s2 then
      lv[i], en[i] = s1, s2
    else
      lv[i] = 0
      if kind[i] == 'r' then
        en[i] = now + set.v1[i]
      elseif now < set.v1[i] then en[i] = set.v1[i]
      elseif now < set.v2[i] then en[i] = set.v2[i]
      else en[i] = set.v3[i] end
    end
    packed[2 * i], packed[2 * i + 1] = lv[i], en[i]
  end

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
  elseif op == 'a' then
    -- A bucket may go below zero (down to -1e9) and wait it off; a quota's count never
    -- goes below zero.
    for i = 1, count do
      if kind[i] == 'b' then
        lv[i] = max(-1e9, min(a[i], lv[i] - cost))
      else
        lv[i] = max(0, min(2 * a[i], lv[i] + cost))
      end
    end
  end
  packed[1] = admitted
  local r = struct.pack(set.fmt, unpack(packed, 1, 1 + 2 * count))

  if op ~= 'p' then
    local m, keep = 0, 0
    for i = 1, count do
      local want
      out[m + 1], out[m + 2], out[m + 3] = set.field[2 * i - 1], dec(lv[i]), set.field[2 * i]
      if kind[i] == 'b' then
        out[m + 4] = nowstr
        want = math.ceil((a[i] - lv[i]) / set.v1[i] * 1000) + 1000
      else
        out[m + 4] = dec(en[i])
        want = math.ceil((en[i] - now) / 1000) + 1000
      end
      m = m + 4
      if want > keep then keep = want end
    end
    local x = tonumber(s[2 * count + 1])
    if not x or x < nowms + keep then
      out[m + 1], out[m + 2] = 'x', format('%d', nowms + 2 * keep)
      m = m + 2
      redis.call('HSET', key, unpack(out, 1, m))
      redis.call('PEXPIRE', key, 2 * keep)
    else
      redis.call('HSET', key, unpack(out, 1, m))
    end
  end
  return r
end

for k = 1, #keys do
  local op, cost, n = ARGV[at + 1], tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3]) or 1
  local set = sets[tonumber(ARGV[at + 4])]
  at = at + 4
  local ok, r = pcall(set.one and one or many, keys[k], set, op, cost, n)
  status[k] = ok and '1' or '0'
  if ok then
    reply[k + 2] = r
  else
    -- redis.call raises a table { err = message }.
    reply[k + 2] = type(r) == 'table' and tostring(r.err) or tostring(r)
  end
end
reply[2] = table.concat(status)
return reply
