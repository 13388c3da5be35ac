-- tollgate key filter: the part every script that gives a client keys begins with (the
-- gateway puts it before catalog_write.lua, catalog_import.lua and key_filter_build.lua).
--
-- The filter is a Bloom filter of every key hash in the catalog: a bitmap (a string key)
-- of `bits` bits, and its meta (a hash: `bits`, `id` (which build it is), `cursor` (how far
-- its build has read the keys index), `complete` = 1 once it holds every key). A gateway
-- that caches clients loads it and refuses a key it says no client has without a store
-- read; a key is never taken out (a revoked key costs a read, never a refusal).
--
-- A key hash "sha256:<64 hex>" sets 7 bits: each of the hash's first seven 32-bit words
-- (big-endian, hex digits 1-8, 9-16, ...) modulo `bits`; bit n is SETBIT's offset n.

local filter_bits = nil

-- Sets `hash`'s bits in the filter `filter` whose meta is `meta`, if there is one (built
-- or being built): a key given after a build began is in the filter whatever the build's
-- scan sees.
local function filter_add(filter, meta, hash)
  if filter_bits == nil then
    filter_bits = tonumber(redis.call('HGET', meta, 'bits') or '0')
  end
  if filter_bits == 0 then return end
  for i = 0, 6 do
    local word = tonumber(string.sub(hash, 8 + 8 * i, 15 + 8 * i), 16)
    redis.call('SETBIT', filter, word % filter_bits, 1)
  end
end
