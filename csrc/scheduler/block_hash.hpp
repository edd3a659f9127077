// The identity of a full KV block for prefix caching: a deterministic 64-bit hash
// chain over token ids, the same in every process and on every machine (no seed),
// so a router can compute it from a prompt without asking the worker.
//
//   hash(block 0)   = fold(kRootBlockHash, tokens[0 : block_size])
//   hash(block i)   = fold(hash(block i-1), tokens[i*block_size : (i+1)*block_size])
//   fold(h, tokens) = for t in tokens: h = splitmix64(h XOR uint64(t))
//   splitmix64(x)   = x += 0x9E3779B97F4A7C15
//                     x = (x XOR (x >> 30)) * 0xBF58476D1CE4E5B9
//                     x = (x XOR (x >> 27)) * 0x94D049BB133111EB
//                     return x XOR (x >> 31)            (all arithmetic mod 2^64)
//
// A block's hash thus covers its whole prefix. Python sees hashes as signed int64
// (the same 64 bits, two's complement), as the KV-event proto carries them.
//
// A hash only nominates a candidate: the block pool stores each cached block's
// tokens and the registration serial of its parent, and a match must equal both,
// so a hash collision costs a cache miss, never wrong KV. Tests narrow hashes to a
// few bits (`mask`) to make collisions common and exercise that path.
#pragma once

#include <cstdint>

namespace tokenspeed {

inline constexpr uint64_t kRootBlockHash = 0x7473'6b76'5f72'6f6fULL;  // "tskv_roo"

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Hash of one block given its parent's hash (kRootBlockHash for the first block).
inline uint64_t chain_block_hash(uint64_t parent_hash, const int64_t* tokens, int32_t num_tokens,
                                 uint64_t mask = ~uint64_t{0}) {
  uint64_t h = parent_hash;
  for (int32_t i = 0; i < num_tokens; ++i) h = splitmix64(h ^ static_cast<uint64_t>(tokens[i]));
  return h & mask;
}

}  // namespace tokenspeed
