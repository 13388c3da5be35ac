-- tollgate key filter, build: one step of putting every key of the keys index in the key
-- filter (see key_filter.lua, which comes before this). Steps from several gateways at
-- once share one build: the cursor is in the meta, and each step runs alone.
--
-- KEYS[1] keys (hash: "sha256:<hex>" -> client id)   KEYS[2] the filter   KEYS[3] its meta
-- ARGV[1] the filter's size in bits, if this step starts it   ARGV[2] keys per step
-- ARGV[3] a new build's id
--
-- A build that starts sets the meta before it reads a key: every key given from then on
-- is set by the script that gives it (HSCAN returns every key there for the whole scan;
-- one added during it is set by its writer).
--
-- Returns { 'complete', bits, id } once every key is in, else { 'building', keys read
-- in this step }.

local bits = tonumber(redis.call('HGET', KEYS[3], 'bits') or '0')
if bits == 0 then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[3], 'bits', ARGV[1], 'id', ARGV[3], 'cursor', '0', 'complete', '0')
  bits = tonumber(ARGV[1])
end
if redis.call('HGET', KEYS[3], 'complete') == '1' then
  return { 'complete', bits, redis.call('HGET', KEYS[3], 'id') }
end
local cursor = redis.call('HGET', KEYS[3], 'cursor') or '0'
local page = redis.call('HSCAN', KEYS[1], cursor, 'COUNT', ARGV[2])
local fields = page[2]
for i = 1, #fields, 2 do filter_add(KEYS[2], KEYS[3], fields[i]) end
if page[1] == '0' then
  redis.call('HSET', KEYS[3], 'complete', '1', 'cursor', '0')
  return { 'complete', bits, redis.call('HGET', KEYS[3], 'id') }
end
redis.call('HSET', KEYS[3], 'cursor', page[1])
return { 'building', #fields / 2 }
