-- tollgate limits: every limit that applies to a request, decided at once, atomically, for
-- the requests of many clients in one call.
--
-- A plan is a set of limits (token buckets and quotas); one entry decides them all for
-- one client: a request any limit refuses spends from none. A worker sends the entries
-- that queued up during one turn of its event loop together, so Redis pays its per-call
-- cost once for them all. The entries of a call are of distinct clients (the gateway
-- sends a second entry of a client in a call of its own), so their order does not matter.
--
-- State lives in a few "group" hashes, not one key per client: a call reads every state
-- it needs with one HMGET per group and writes them back with one HSET per group, so a
-- decision costs a few hash lookups, not two commands. A client's state for a limit is
-- the field '<tag>' (the plan's first limit) or '<tag>/<name>:' (any other), where <tag>
-- is its bucket's hash tag ('acme', or 'acme:eu' for a regional shard); ids never hold
-- '/', so fields never collide. A value is struct '<ddd': a bucket's tokens and the time
-- (unix µs) they were counted at, or a quota's count and its window's end; then the time
-- (unix µs) after which the field says nothing a missing one would not (a bucket full
-- again, a window over, +1 s). A quota's third number ends in half a microsecond, a
-- bucket's is whole (exact while times stay below 2^52 µs, the year 2112): the quota's
-- mark, so that a bucket never reads a quota's state (a limit redefined from a quota into
-- a bucket under its name, or a client moved to a plan where the name is a bucket, starts
-- as a bucket that does not exist yet, as the embedded store's does). A quota reads a bucket's state as a window that is over (the bucket's
-- time is Redis' now when written). Gateways from before the mark read the third number
-- only to sweep, so a fleet upgrades replica by replica; a quota field they wrote has no
-- mark, and reads as a quota still. Groups have no expiry: a call may also sweep its first
-- group, deleting such fields a slice at a time (HSCAN from the cursor kept in the
-- group's mark, field '~', which every call reads with its fields).
--
-- KEYS = the call's group hashes. ARGV[1] = m, then m more groups: on a cluster a call
-- declares only its first group (which routes it to its master) and passes the other
-- groups of that master here; a group whose slot moved fails its own entries only.
-- The groups are KEYS, then these.
-- Then the least number of fields of the first group to sweep if a sweep is due (0: no
-- sweep);
-- then the number of limit sets; then each set: its number of limits, and six
-- arguments per limit: its field suffix ('' or '/name:'), its kind, and four values:
--   'b' bucket:  capacity, rate (tokens/s), the tokens a bucket that does not exist yet
--                starts with ('' = full: used when a client moves between its global
--                bucket and regional shards), unused;
--   'q' quota on calendar or anchor windows: amount, then the ends (unix µs) of the
--                previous, current and next windows around the gateway's clock: Redis'
--                own clock picks among them, so gateway clocks never matter;
--   'r' rolling quota: amount, the window's length (µs) if one started now, unused x2.
-- Then the entries, in runs of entries alike: one binary argument, struct '<HBdIHH' per
-- run: its length, then its entries' op, cost (tokens), n (requests; 't' only), limit
-- set (1-based) and group (1-based); a group's runs are consecutive. Then one argument
-- per entry, in run order: its tag.
--   op: 116 't': take `cost` for each of `n` requests that arrived together, in order;
--        97 'a': adjust every limit by `cost` (a debit, or a refund when negative)
--                whatever the balance: a cost reported after the response;
--       112 'p': peek (refill and reset, return the levels, write nothing).
--
-- The time comes from Redis itself (TIME), once per call. The arithmetic is
-- engine/src/limits/take.rs's (`Level::at`, then `take_many` / `Level::adjust`),
-- operation for operation, so the embedded store decides identically and the gateway
-- replays the takes to give each request its own answer.
--
-- Returns { now (µs, decimal), a status per entry ('1' decided, '0' failed), the decided
-- entries' levels, then the failed entries' errors in order }. The levels are
-- little-endian doubles, before any take: one per entry of a set of one bucket (its
-- tokens after refilling); two per limit for any other set (a bucket's tokens and 0, a
-- quota's count and its window's end).
--
-- The hot paths (a set of one bucket) are written for Lua 5.1's interpreter, where each
-- operation costs: no function calls, comparisons instead of math.min, tables built in
-- one piece where possible. A call of one such entry takes the lean path first, which
-- builds no table but its reply (src/store/redis/script_paths.rs checks that both paths
-- decide, answer and write alike).

-- The lean path: a call of one entry of a set of one bucket, with no sweep due, the call
-- a request makes alone when its client has nothing else in flight (most of them, with
-- many clients and not much load). The same reads, arithmetic and writes as the general
-- path below, without its tables and formats: about 40% less of the call's cost (79k
-- instructions in Redis, from 140k: bench/scripts/script-cost.sh 1). Any error
-- falls through to the general path, which meets it again (nothing was written: HSET
-- writes all of its fields or none) and answers it as it answers every error.
-- Its arithmetic is the general path's one-bucket loop written out again, on purpose: one
-- local function for both cost 14% more instructions per lone call and 9% more per
-- decision of a batch of 32 (script-cost.sh), and script_paths.rs keeps the two alike.
local argv = ARGV
if #argv == 12 and argv[1] == '0' and argv[2] == '0' and argv[3] == '1' and argv[4] == '1'
    and argv[5] == '' and argv[6] == 'b' then
  local _, op, cost, n = struct.unpack('<HBdI', argv[11])
  local t = redis.call('TIME')
  local key, tag = KEYS[1], argv[12]
  local st = redis.pcall('HMGET', key, '~', tag)
  if not st.err then
    local now = t[1] * 1000000 + t[2]
    local cap, rate = tonumber(argv[7]), tonumber(argv[8])
    local v, lv = st[2], nil
    if v and #v == 24 then
      local at, over
      lv, at, over = struct.unpack('<ddd', v)
      if over % 1 ~= 0 then
        lv = nil -- a quota's state (its mark): none of this bucket's
      else
        local elapsed = now - at
        if elapsed > 0 then lv = lv + elapsed * rate / 1000000 end
      end
    end
    if not lv then lv = tonumber(argv[9]) or cap end
    if lv > cap then lv = cap end
    local level, written = lv, true
    if op ~= 112 then
      if op == 116 then
        local a = 0
        while a < n and lv >= cost do
          lv = lv - cost
          a = a + 1
        end
      elseif op == 97 then
        lv = lv - cost
        if lv > cap then lv = cap end
        if lv < -1e9 then lv = -1e9 end
      end
      local q = (cap - lv) / rate * 1000000
      local c = q - q % 1
      if c < q then c = c + 1 end
      local value = struct.pack('<ddd', lv, now, now + c + 1000000)
      local w
      if st[1] then
        w = redis.pcall('HSET', key, tag, value)
      else
        -- A new group, and its mark: MARK0 below.
        w = redis.pcall('HSET', key, tag, value, '~',
          '0 0                                                                        ')
      end
      written = type(w) ~= 'table'
    end
    if written then
      return { t[1] .. string.sub('00000' .. t[2], -6), '1', struct.pack('<d', level) }
    end
  end
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local nowstr = t[1] .. string.format('%06d', tonumber(t[2]))
local min, max, rep, concat = math.min, math.max, string.rep, table.concat
local pack, unpack_s, call = struct.pack, struct.unpack, redis.call

local keys, m = KEYS, tonumber(argv[1])
if m > 0 then
  keys = {}
  for k = 1, #KEYS do keys[k] = KEYS[k] end
  for k = 1, m do keys[#KEYS + k] = argv[1 + k] end
end
local sweep = tonumber(argv[2 + m])

-- The limit sets.
local sets = {}
local at = 3 + m
for s = 1, tonumber(argv[at]) do
  local count = tonumber(argv[at + 1])
  if count == 1 and argv[at + 2] == '' and argv[at + 3] == 'b' then
    -- One bucket, the commonest plan.
    sets[s] = { one = true, count = 1, cap = tonumber(argv[at + 4]),
      rate = tonumber(argv[at + 5]), init = tonumber(argv[at + 6]) }
  else
    local set = { count = count, suffix = {}, kind = {}, a = {}, v1 = {}, v2 = {}, v3 = {} }
    for i = 1, count do
      local base = at + 1 + (i - 1) * 6
      set.suffix[i], set.kind[i], set.a[i] = argv[base + 1], argv[base + 2], tonumber(argv[base + 3])
      set.v1[i], set.v2[i], set.v3[i] =
        tonumber(argv[base + 4]), tonumber(argv[base + 5]), tonumber(argv[base + 6])
    end
    sets[s] = set
  end
  at = at + 1 + 6 * count
end

-- The runs.
local runs = argv[at + 1]
local nruns = #runs / 19
local rv = { unpack_s('<' .. rep('HBdIHH', nruns), runs) }
local first_tag = at + 2

-- Per group: its first run and its last, and where its tags start and end.
local gfirst, glast, gtag0, gtag1 = {}, {}, {}, {}
do
  local tag = first_tag
  for r = 1, nruns do
    local b = 6 * r - 6
    local g = rv[b + 6]
    if not gfirst[g] then gfirst[g], gtag0[g] = r, tag end
    glast[g] = r
    tag = tag + rv[b + 1]
    gtag1[g] = tag - 1
  end
end

-- A group's mark (field '~'): the sweep's HSCAN cursor and when its next slice is due
-- (unix µs), padded past `hash-max-listpack-value` (64 bytes by default).
local PAD = rep(' ', 72)
local MARK0 = '0 0' .. PAD
local mark1, wrote1
local status, levels, errors = {}, {}, {}
local nstatus, nlevels = 0, 0
-- A missing field's numbers (Lua 5.1 does not fold -1 / 0: computed once, here).
local NONE = -1 / 0
local MISSING = pack('<ddd', NONE, 0, 0)

-- A group whose slot moved (a cluster) fails its entries only: their status '0' and
-- its error.
local function fail(g, err)
  for r = gfirst[g], glast[g] do
    for _ = 1, rv[6 * r - 5] do
      nstatus = nstatus + 1
      status[nstatus] = '0'
      errors[#errors + 1] = err
    end
  end
end

local function message(e)
  return type(e) == 'table' and tostring(e.err) or tostring(e)
end

for g = 1, #keys do
  if gfirst[g] then
    local key, r0, r1 = keys[g], gfirst[g], glast[g]
    -- The fields to read: the tags themselves when every run of the group is of a set
    -- of one bucket, else built.
    local plain = true
    for r = r0, r1 do
      if not sets[rv[6 * r - 1]].one then plain = false end
    end
    local fields
    if not plain then
      fields = {}
      local tag = gtag0[g]
      for r = r0, r1 do
        local b = 6 * r - 6
        local set = sets[rv[b + 5]]
        for _ = 1, rv[b + 1] do
          if set.one then
            fields[#fields + 1] = argv[tag]
          else
            for l = 1, set.count do fields[#fields + 1] = argv[tag] .. set.suffix[l] end
          end
          tag = tag + 1
        end
      end
    end
    -- The group's mark ('~') first.
    local ok, st
    if plain then
      ok, st = pcall(call, 'HMGET', key, '~', unpack(argv, gtag0[g], gtag1[g]))
    else
      ok, st = pcall(call, 'HMGET', key, '~', unpack(fields))
    end
    if not ok then
      fail(g, message(st))
    else
      local nf = #st
      for i = 2, nf do
        local v = st[i]
        if not v or #v ~= 24 then st[i] = MISSING end
      end
      -- Three numbers per field: level, time or window end, sweepable after.
      local num = { unpack_s('<' .. rep('ddd', nf - 1), concat(st, '', 2, nf)) }
      local writes, nw = {}, 0
      if g == 1 then mark1 = st[1] end
      local saved_status, saved_levels = nstatus, nlevels
      local tag, j = gtag0[g], 1
      for r = r0, r1 do
        local b = 6 * r - 6
        local len, op, cost, n, set = rv[b + 1], rv[b + 2], rv[b + 3], rv[b + 4], sets[rv[b + 5]]
        if set.one then
          local cap, rate, init = set.cap, set.rate, set.init or set.cap
          local take, write = op == 116, op ~= 112
          for _ = 1, len do
            local lv = num[j]
            if lv == NONE or num[j + 2] % 1 ~= 0 then
              lv = init
            else
              local elapsed = now - num[j + 1]
              if elapsed > 0 then lv = lv + elapsed * rate / 1000000 end
            end
            if lv > cap then lv = cap end
            nlevels = nlevels + 1
            levels[nlevels] = lv
            if take then
              local a = 0
              while a < n and lv >= cost do
                lv = lv - cost
                a = a + 1
              end
            elseif op == 97 then
              lv = max(-1e9, min(cap, lv - cost))
            end
            if write then
              -- Sweepable once full again (µs from now, rounded up), +1 s.
              local q = (cap - lv) / rate * 1000000
              local c = q - q % 1
              if c < q then c = c + 1 end
              writes[nw + 1], writes[nw + 2] = argv[tag], pack('<ddd', lv, now, now + c + 1000000)
              nw = nw + 2
            end
            nstatus = nstatus + 1
            status[nstatus] = '1'
            tag, j = tag + 1, j + 3
          end
        else
          local count, kind, a = set.count, set.kind, set.a
          local lv, en = {}, {}
          for _ = 1, len do
            -- Levels now: buckets refilled, quotas reset when their window is over.
            for i = 1, count do
              local x = j + 3 * (i - 1)
              local s1, s2 = num[x], num[x + 1]
              if s1 == NONE then s1, s2 = nil, nil end
              en[i] = 0
              if kind[i] == 'b' then
                -- A quota's state (its mark) is none of a bucket's.
                if num[x + 2] % 1 ~= 0 then s1, s2 = nil, nil end
                local tokens = s1 or min(a[i], set.v2[i] or a[i])
                local elapsed = now - (s2 or now)
                if elapsed < 0 then elapsed = 0 end
                lv[i] = min(a[i], tokens + elapsed * set.v1[i] / 1000000)
              elseif s1 and now < s2 then
                lv[i], en[i] = s1, s2
              else
                lv[i] = 0
                if kind[i] == 'r' then
                  en[i] = now + set.v1[i]
                elseif now < set.v1[i] then en[i] = set.v1[i]
                elseif now < set.v2[i] then en[i] = set.v2[i]
                else en[i] = set.v3[i] end
              end
              levels[nlevels + 1], levels[nlevels + 2] = lv[i], en[i]
              nlevels = nlevels + 2
            end
            if op == 116 then
              -- Once one request is refused the rest are too: they all cost the same.
              local fits, admitted = true, 0
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
            elseif op == 97 then
              -- A bucket may go below zero (down to -1e9) and wait it off; a quota's
              -- count never goes below zero.
              for i = 1, count do
                if kind[i] == 'b' then
                  lv[i] = max(-1e9, min(a[i], lv[i] - cost))
                else
                  lv[i] = max(0, min(2 * a[i], lv[i] + cost))
                end
              end
            end
            if op ~= 112 then
              for i = 1, count do
                local over
                if kind[i] == 'b' then
                  over = now + math.ceil((a[i] - lv[i]) / set.v1[i] * 1000000) + 1000000
                  writes[nw + 2] = pack('<ddd', lv[i], now, over)
                else
                  writes[nw + 2] = pack('<ddd', lv[i], en[i], en[i] + 1000000.5)
                end
                writes[nw + 1] = argv[tag] .. set.suffix[i]
                nw = nw + 2
              end
            end
            nstatus = nstatus + 1
            status[nstatus] = '1'
            tag, j = tag + 1, j + 3 * count
          end
        end
      end
      -- One HSET per group. One that fails fails the group's entries: nothing they
      -- decided was kept.
      if nw > 0 then
        if not st[1] then
          -- A new group: its mark, longer than a listpack value may be, so Redis keeps
          -- the group as a hash table from the start (a listpack finds a field by
          -- walking every entry: up to 512 of them with Redis' defaults). Peeks alone
          -- write nothing, not even this.
          writes[nw + 1], writes[nw + 2] = '~', MARK0
          nw = nw + 2
        end
        local wok, e = pcall(call, 'HSET', key, unpack(writes, 1, nw))
        if wok and g == 1 then wrote1 = true end
        if not wok then
          nstatus, nlevels = saved_status, saved_levels
          fail(g, message(e))
        end
      end
    end
  end
end

-- A slice of the first group's fields whose time is over (written before this call: a
-- field this call wrote is never over). At most once a second per group, whatever the
-- number of gateways asking (field '~' holds the HSCAN cursor and when the next slice is
-- due, unix µs); a slice is a sixtieth of the group, so a group is swept through about
-- once a minute. Not in a group that does not exist (a call of peeks writes nothing).
if sweep > 0 and status[1] == '1' and (mark1 or wrote1) then
  local cursor, due = '0', 0
  if mark1 then
    local c, d = string.match(mark1, '^(%d+) (%d+)')
    if c then cursor, due = c, tonumber(d) end
  end
  if now >= due then
    local r = call('HSCAN', keys[1], cursor, 'COUNT', max(sweep, math.ceil(call('HLEN', keys[1]) / 60)))
    local items, gone = r[2], {}
    for i = 1, #items, 2 do
      local v = items[i + 1]
      if #v == 24 then
        local _, _, over = unpack_s('<ddd', v)
        if over < now then gone[#gone + 1] = items[i] end
      end
    end
    if #gone > 0 then call('HDEL', keys[1], unpack(gone)) end
    call('HSET', keys[1], '~', r[1] .. ' ' .. string.format('%d', now + 1000000) .. PAD)
  end
end

local reply = { nowstr, concat(status, '', 1, nstatus),
  nlevels > 0 and pack('<' .. rep('d', nlevels), unpack(levels, 1, nlevels)) or '' }
for e = 1, #errors do reply[3 + e] = errors[e] end
return reply
