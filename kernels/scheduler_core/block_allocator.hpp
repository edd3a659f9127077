// The block pool of the paged KV cache, and the move-only handle through which a
// request owns its blocks.
//
// Vocabulary: a *block* is a fixed run of block_size KV positions; a *slot* is one
// position (block_id * block_size + offset); a request's *block table* lists its
// blocks in sequence order.
//
// Blocks carry reference counts although, today, every block has exactly one owner:
// prefix caching (a later change) will let several requests share a full block
// through share(). The pool refuses double frees and, when destroyed, aborts if any
// block is still referenced: both are bugs in the scheduler, never user errors.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace tokenspeed {

using BlockId = int32_t;

class BlockAllocator {
 public:
  explicit BlockAllocator(int32_t num_blocks) : ref_counts_(num_blocks, 0) {
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

  // Takes the least recently freed block (FIFO keeps recently freed blocks intact
  // longest, which the prefix cache's LRU eviction will want).
  BlockId allocate() {
    if (free_.empty()) throw std::logic_error("block pool exhausted: allocate() with no free block");
    BlockId block = free_.front();
    free_.pop_front();
    ref_counts_[block] = 1;
    return block;
  }

  // One more owner of an already referenced block (prefix reuse).
  void share(BlockId block) {
    check_range(block);
    if (ref_counts_[block] == 0)
      throw std::logic_error("share() of free block " + std::to_string(block));
    ++ref_counts_[block];
  }

  // Drops one reference; the block returns to the pool at zero.
  void release(BlockId block) {
    check_range(block);
    if (ref_counts_[block] == 0)
      throw std::logic_error("double free of block " + std::to_string(block));
    if (--ref_counts_[block] == 0) free_.push_back(block);
  }

  int32_t ref_count(BlockId block) const {
    check_range(block);
    return ref_counts_[block];
  }

 private:
  void check_range(BlockId block) const {
    if (block < 0 || block >= num_blocks())
      throw std::out_of_range("block id " + std::to_string(block) + " out of range");
  }

  std::vector<int32_t> ref_counts_;
  std::deque<BlockId> free_;
};

// A request's blocks, in sequence order. Move-only: exactly one request state owns
// a given table, and destroying the table returns its blocks to the pool.
class BlockTable {
 public:
  explicit BlockTable(BlockAllocator& allocator) : allocator_(&allocator) {}
  ~BlockTable() { release_all(); }

  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;
  BlockTable(BlockTable&& other) noexcept
      : allocator_(other.allocator_), blocks_(std::move(other.blocks_)) {
    other.blocks_.clear();
  }
  BlockTable& operator=(BlockTable&& other) noexcept {
    if (this != &other) {
      release_all();
      allocator_ = other.allocator_;
      blocks_ = std::move(other.blocks_);
      other.blocks_.clear();
    }
    return *this;
  }

  // Appends blocks until the table holds num_blocks; the caller checked the pool.
  void grow_to(int32_t num_blocks) {
    while (size() < num_blocks) blocks_.push_back(allocator_->allocate());
  }

  int32_t size() const { return static_cast<int32_t>(blocks_.size()); }
  const std::vector<BlockId>& ids() const { return blocks_; }

 private:
  void release_all() noexcept {
    // A throw here (double free) terminates the process: the pool is corrupt.
    for (BlockId block : blocks_) allocator_->release(block);
    blocks_.clear();
  }

  BlockAllocator* allocator_;
  std::vector<BlockId> blocks_;
};

}  // namespace tokenspeed
