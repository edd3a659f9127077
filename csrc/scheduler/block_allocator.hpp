// The block pool of the paged KV cache, with its prefix cache, and the move-only
// handle through which a request owns its blocks.
//
// Vocabulary: a *block* is a fixed run of block_size KV positions; a *slot* is one
// position (block_id * block_size + offset); a request's *block table* lists its
// blocks in sequence order. A *cached* block is a full block registered under its
// chain hash (block_hash.hpp) so later requests with the same prefix can share it.
//
// Every block is in exactly one of three states:
//   free        ref 0, unregistered, on the free list;
//   evictable   ref 0, registered, on the LRU list: its K/V is kept and matchable
//               until allocate() needs the block (least recently released first);
//   referenced  ref > 0, owned by that many block tables (registered or not).
// allocate() takes free blocks first, then evicts, so "available" = free + evictable.
// With retain_cached off, a registered block reaching ref 0 is unregistered and
// freed at once: only blocks some request still holds stay matchable.
//
// Exactness: each registered block stores its tokens and the registration serial of
// its parent block; lookup() matches only when both equal, so by induction from the
// root a matched chain holds exactly the K/V of the tokens asked for, whatever the
// hashes do. Serials are never reused, so an evicted parent cannot be confused with
// the block that later takes its id.
//
// The pool refuses double frees and, when destroyed, aborts if any block is still
// referenced: both are bugs in the scheduler, never user errors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tokenspeed {

using BlockId = int32_t;
// A table entry whose block was released while the request runs (its positions slid out of
// every future query's sliding window): nothing reads it; plans show it as block 0.
inline constexpr BlockId kReleasedBlock = -1;

// Registration serials: 0 = none (unregistered, or a chain that cannot be cached
// further), 1 = the root (parent of every first block), >= 2 = one registration.
inline constexpr uint64_t kNoSerial = 0;
inline constexpr uint64_t kRootSerial = 1;

struct KvEvent {
  enum class Kind { kStored, kRemoved, kCleared };
  Kind kind;
  uint64_t block_hash = 0;
  bool has_parent = false;
  uint64_t parent_hash = 0;
  std::vector<int64_t> token_ids;  // kStored only
};

struct CachedBlockInfo {
  uint64_t hash = 0;
  bool has_parent = false;
  uint64_t parent_hash = 0;
  uint64_t serial = kNoSerial;  // kNoSerial: not registered
  uint64_t parent_serial = kNoSerial;
  std::vector<int64_t> tokens;
};

class BlockAllocator {
 public:
  explicit BlockAllocator(int32_t num_blocks, bool retain_cached = true, bool record_events = false)
      : retain_cached_(retain_cached),
        record_events_(record_events),
        ref_counts_(std::max(num_blocks, 0), 0),
        lru_prev_(std::max(num_blocks, 0), kNone),
        lru_next_(std::max(num_blocks, 0), kNone),
        evictable_(std::max(num_blocks, 0), 0),
        cached_(std::max(num_blocks, 0)) {
    if (num_blocks < 1) throw std::invalid_argument("num_blocks must be >= 1");
    for (BlockId b = 0; b < num_blocks; ++b) free_.push_back(b);
  }

  ~BlockAllocator() {
    int32_t leaked = 0;
    for (int32_t count : ref_counts_) leaked += count > 0;
    if (leaked > 0) {
      std::fprintf(stderr,
                   "tokenspeed scheduler core: block pool destroyed with %d block(s) "
                   "still referenced (leak)\n",
                   leaked);
      std::abort();
    }
  }

  BlockAllocator(const BlockAllocator&) = delete;
  BlockAllocator& operator=(const BlockAllocator&) = delete;

  int32_t num_blocks() const { return static_cast<int32_t>(ref_counts_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t num_evictable() const { return num_evictable_; }
  // Blocks allocate() can hand out now: free + evictable.
  int32_t num_available() const { return num_free() + num_evictable_; }
  int32_t num_cached() const { return static_cast<int32_t>(by_hash_.size()); }

  // A free block if there is one (the least recently freed), else the least
  // recently released evictable block, which loses its registration.
  BlockId allocate() {
    BlockId block;
    if (!free_.empty()) {
      block = free_.front();
      free_.pop_front();
    } else if (lru_head_ != kNone) {
      block = lru_head_;
      unlink_lru(block);
      unregister(block);
    } else {
      throw std::logic_error("block pool exhausted: allocate() with no free or evictable block");
    }
    ref_counts_[block] = 1;
    return block;
  }

  // One more owner of a referenced block, or the first owner of an evictable one
  // (a prefix match takes it off the LRU list). A free block cannot be shared.
  void share(BlockId block) {
    check_range(block);
    if (ref_counts_[block] == 0) {
      if (!evictable_[block]) throw std::logic_error("share() of free block " + std::to_string(block));
      unlink_lru(block);
    }
    ++ref_counts_[block];
  }

  // Drops one reference. At zero a registered block becomes evictable (or, with
  // retain_cached off, is unregistered), an unregistered one free.
  void release(BlockId block) {
    check_range(block);
    if (ref_counts_[block] == 0) throw std::logic_error("double free of block " + std::to_string(block));
    if (--ref_counts_[block] > 0) return;
    if (is_registered(block) && retain_cached_) {
      push_lru(block);
      return;
    }
    if (is_registered(block)) unregister(block);
    free_.push_back(block);
  }

  int32_t ref_count(BlockId block) const {
    check_range(block);
    return ref_counts_[block];
  }
  bool is_evictable(BlockId block) const {
    check_range(block);
    return evictable_[block] != 0;
  }
  bool is_registered(BlockId block) const { return cached_[block].serial != kNoSerial; }
  uint64_t serial(BlockId block) const { return cached_[block].serial; }
  const CachedBlockInfo& cached_info(BlockId block) const {
    check_range(block);
    return cached_[block];
  }

  // Registers a referenced, full, computed block under `hash`. Returns the serial
  // that stands for this block's content from now on: its own new one; that of an
  // entry already holding `hash` with the same tokens and parent (this block then
  // stays private); or kNoSerial when `hash` is held by other content (a collision:
  // this block and its descendants stay private).
  uint64_t register_block(BlockId block, uint64_t hash, const uint64_t* parent_hash, uint64_t parent_serial,
                          const int64_t* tokens, int32_t num_tokens) {
    check_range(block);
    if (ref_counts_[block] == 0) throw std::logic_error("register_block() of unreferenced block");
    if (is_registered(block)) throw std::logic_error("block " + std::to_string(block) + " registered twice");
    auto it = by_hash_.find(hash);
    if (it != by_hash_.end()) {
      const CachedBlockInfo& held = cached_[it->second];
      return same_content(held, parent_serial, tokens, num_tokens) ? held.serial : kNoSerial;
    }
    CachedBlockInfo& info = cached_[block];
    info.hash = hash;
    info.has_parent = parent_hash != nullptr;
    info.parent_hash = parent_hash ? *parent_hash : 0;
    info.serial = next_serial_++;
    info.parent_serial = parent_serial;
    info.tokens.assign(tokens, tokens + num_tokens);
    by_hash_.emplace(hash, block);
    if (record_events_)
      events_.push_back(KvEvent{KvEvent::Kind::kStored, hash, info.has_parent, info.parent_hash, info.tokens});
    return info.serial;
  }

  // The cached block whose content is exactly `tokens` after the block registered
  // as `parent_serial`, or -1.
  BlockId lookup(uint64_t hash, uint64_t parent_serial, const int64_t* tokens, int32_t num_tokens) const {
    if (parent_serial == kNoSerial) return -1;
    auto it = by_hash_.find(hash);
    if (it == by_hash_.end()) return -1;
    return same_content(cached_[it->second], parent_serial, tokens, num_tokens) ? it->second : -1;
  }

  // Unregisters every cached block: evictable ones become free, referenced ones stay
  // with their owners but are no longer matchable. Returns the blocks dropped.
  int32_t flush() {
    const int32_t dropped = num_cached();
    while (lru_head_ != kNone) {
      BlockId block = lru_head_;
      unlink_lru(block);
      free_.push_back(block);
    }
    for (auto& [hash, block] : by_hash_) clear_entry(block);
    by_hash_.clear();
    if (record_events_) events_.push_back(KvEvent{KvEvent::Kind::kCleared, 0, false, 0, {}});
    return dropped;
  }

  std::vector<KvEvent> drain_events() { return std::exchange(events_, {}); }

 private:
  static constexpr BlockId kNone = -1;

  void check_range(BlockId block) const {
    if (block < 0 || block >= num_blocks())
      throw std::out_of_range("block id " + std::to_string(block) + " out of range");
  }

  static bool same_content(const CachedBlockInfo& info, uint64_t parent_serial, const int64_t* tokens,
                           int32_t num_tokens) {
    return info.parent_serial == parent_serial && static_cast<int32_t>(info.tokens.size()) == num_tokens &&
           std::equal(info.tokens.begin(), info.tokens.end(), tokens);
  }

  void unregister(BlockId block) {
    const uint64_t hash = cached_[block].hash;
    by_hash_.erase(hash);
    clear_entry(block);
    if (record_events_) events_.push_back(KvEvent{KvEvent::Kind::kRemoved, hash, false, 0, {}});
  }

  void clear_entry(BlockId block) {
    cached_[block].serial = kNoSerial;
    cached_[block].tokens.clear();
  }

  // Evictable blocks form an intrusive doubly linked list: head = next victim.
  void push_lru(BlockId block) {
    lru_prev_[block] = lru_tail_;
    lru_next_[block] = kNone;
    if (lru_tail_ != kNone) lru_next_[lru_tail_] = block;
    else lru_head_ = block;
    lru_tail_ = block;
    evictable_[block] = 1;
    ++num_evictable_;
  }

  void unlink_lru(BlockId block) {
    const BlockId prev = lru_prev_[block], next = lru_next_[block];
    if (prev != kNone) lru_next_[prev] = next;
    else lru_head_ = next;
    if (next != kNone) lru_prev_[next] = prev;
    else lru_tail_ = prev;
    lru_prev_[block] = lru_next_[block] = kNone;
    evictable_[block] = 0;
    --num_evictable_;
  }

  bool retain_cached_;
  bool record_events_;
  std::vector<int32_t> ref_counts_;
  std::deque<BlockId> free_;
  std::vector<BlockId> lru_prev_, lru_next_;
  std::vector<uint8_t> evictable_;
  BlockId lru_head_ = kNone, lru_tail_ = kNone;
  int32_t num_evictable_ = 0;
  std::vector<CachedBlockInfo> cached_;  // by block id
  std::unordered_map<uint64_t, BlockId> by_hash_;
  uint64_t next_serial_ = kRootSerial + 1;
  std::vector<KvEvent> events_;
};

// A request's blocks, in sequence order. Move-only: exactly one request state owns
// a given table, and destroying the table returns its blocks to the pool, tail
// first, so that among blocks released together a sequence's tail is evicted
// before its prefix.
//
// The table also carries its *chain*: for each leading full block, the serial of
// the registered block with the same content (block_allocator.hpp). The chain
// stops growing when it breaks (a hash collision, or a cache flush).
class BlockTable {
 public:
  explicit BlockTable(BlockAllocator& allocator) : allocator_(&allocator) {}
  ~BlockTable() { release_all(); }

  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;
  BlockTable(BlockTable&& other) noexcept
      : allocator_(other.allocator_),
        blocks_(std::move(other.blocks_)),
        chain_(std::move(other.chain_)),
        chain_broken_(other.chain_broken_),
        released_(other.released_) {
    other.blocks_.clear();
    other.chain_.clear();
    other.released_ = 0;
  }
  BlockTable& operator=(BlockTable&& other) noexcept {
    if (this != &other) {
      release_all();
      allocator_ = other.allocator_;
      blocks_ = std::move(other.blocks_);
      chain_ = std::move(other.chain_);
      chain_broken_ = other.chain_broken_;
      released_ = other.released_;
      other.blocks_.clear();
      other.chain_.clear();
      other.released_ = 0;
    }
    return *this;
  }

  // Appends a full block matched from the cache (or a sibling), taking a
  // reference; `serial` is its content's registration (kNoSerial: none).
  void append_matched(BlockId block, uint64_t serial) {
    allocator_->share(block);
    blocks_.push_back(block);
    extend_chain(serial);
  }

  // Appends fresh blocks until the table holds num_blocks; the caller checked the pool.
  void grow_to(int32_t num_blocks) {
    while (size() < num_blocks) blocks_.push_back(allocator_->allocate());
  }

  // Releases the trailing entries past num_blocks (slots of rejected draft tokens); never one
  // released before or registered (the caller keeps every computed block).
  void shrink_to(int32_t num_blocks) {
    while (size() > std::max(num_blocks, released_)) {
      allocator_->release(blocks_.back());
      blocks_.pop_back();
    }
  }

  int32_t size() const { return static_cast<int32_t>(blocks_.size()); }
  const std::vector<BlockId>& ids() const { return blocks_; }

  // Releases the blocks of entries [0, num_blocks) not released yet, leaving kReleasedBlock in
  // their place (positions keep their entries); returns how many were released.
  int32_t release_before(int32_t num_blocks) {
    int32_t released = 0;
    for (; released_ < std::min(num_blocks, size()); ++released_, ++released) {
      allocator_->release(blocks_[released_]);
      blocks_[released_] = kReleasedBlock;
    }
    return released;
  }
  int32_t num_released() const { return released_; }

  const std::vector<uint64_t>& chain() const { return chain_; }
  bool chain_broken() const { return chain_broken_; }
  void extend_chain(uint64_t serial) {
    if (chain_broken_) return;
    if (serial == kNoSerial) chain_broken_ = true;
    else chain_.push_back(serial);
  }
  void break_chain() { chain_broken_ = true; }

 private:
  void release_all() noexcept {
    // A throw here (double free) terminates the process: the pool is corrupt.
    for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it) {
      if (*it != kReleasedBlock) allocator_->release(*it);
    }
    blocks_.clear();
    chain_.clear();
    released_ = 0;
  }

  BlockAllocator* allocator_;
  std::vector<BlockId> blocks_;
  std::vector<uint64_t> chain_;
  bool chain_broken_ = false;
  int32_t released_ = 0;  // entries [0, released_) are kReleasedBlock
};

}  // namespace tokenspeed
