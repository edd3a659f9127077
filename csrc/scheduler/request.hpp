// One request's life as an explicit state machine.
//
//   Waiting ──admit──▶ Prefilling ──first sampled token──▶ Decoding ──▶ Finished
//      ▲                   │                                  │
//      └──── preempt ──────┴──────────────────────────────────┘
//
// Only Prefilling and Decoding own a BlockTable, so a waiting (new or preempted)
// or finished request cannot hold blocks: leaving those states destroys the table,
// which returns the blocks to the pool.
//
// Tokens: `tokens` holds every known token (prompt, then output). `num_computed`
// of them are in the KV cache (the *context*); admission starts it at the tokens of
// the cached prefix blocks it matched. A preempted request keeps its output and
// recomputes its tokens as if they were its prompt (less what it matches again).
//
// A *sibling* (one of the n samples of one prompt) names the request it waits for:
// it is not admitted while that request is waiting or prefilling, then shares its
// prompt blocks. The parent is identified by id and serial, as ids are reused.
//
// Speculative decoding (scheduler.hpp): a decoding request may carry a *draft*, tokens proposed
// to follow its last one; a step computes them with it and keeps those the target model agrees
// with. Drafts are never in `tokens` and never count as computed until accepted.
//
// Overlap scheduling (scheduler.hpp): a step's sampled token can be *pending*: the
// step is committed (its tokens computed) before the sampled value reached the host.
// The token is then kPendingToken in `tokens` until resolved; the next step may
// already compute it, reading its value on the device (the plan names which sample
// of the previous step it is). Pending tokens are always the last ones.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "block_allocator.hpp"
#include "block_hash.hpp"

namespace tokenspeed {

enum class FinishReason : int32_t { kNone = 0, kStop = 1, kLength = 2 };

// The value of a sampled token not resolved yet (token ids are never negative).
constexpr int64_t kPendingToken = -1;

namespace state {
struct Waiting {};
struct Prefilling {
  BlockTable blocks;
};
struct Decoding {
  BlockTable blocks;
};
struct Finished {
  FinishReason reason;
};
}  // namespace state

class Request {
 public:
  Request(int64_t id, uint64_t serial, std::vector<int64_t> prompt, int32_t max_new_tokens,
          std::vector<int64_t> stop_token_ids)
      : id_(id),
        serial_(serial),
        prompt_len_(static_cast<int32_t>(prompt.size())),
        max_new_tokens_(max_new_tokens),
        tokens_(std::move(prompt)),
        stop_token_ids_(std::move(stop_token_ids)),
        state_(state::Waiting{}) {
    tokens_.reserve(tokens_.size() + max_new_tokens);
  }

  int64_t id() const { return id_; }
  uint64_t serial() const { return serial_; }  // unique for the scheduler's lifetime
  int32_t prompt_len() const { return prompt_len_; }
  int32_t num_tokens() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t output_len() const { return num_tokens() - prompt_len_; }
  int32_t max_new_tokens() const { return max_new_tokens_; }
  int32_t num_computed() const { return num_computed_; }
  int32_t num_uncomputed() const { return num_tokens() - num_computed_; }
  const std::vector<int64_t>& tokens() const { return tokens_; }
  // Tokens matched in the prefix cache at the first admission (0 before it).
  int32_t num_cached_tokens() const { return num_cached_tokens_; }
  bool was_admitted() const { return was_admitted_; }

  // The request this sibling waits for, by id and serial; parent_id() < 0: none.
  void set_parent(int64_t id, uint64_t serial) {
    parent_id_ = id;
    parent_serial_ = serial;
  }
  int64_t parent_id() const { return parent_id_; }
  uint64_t parent_serial() const { return parent_serial_; }

  // Chain hash of full block `index` of the known tokens (block_hash.hpp), memoized:
  // tokens never change once known.
  uint64_t block_hash(int32_t index, int32_t block_size, uint64_t mask) {
    while (static_cast<int32_t>(block_hashes_.size()) <= index) {
      const int32_t i = static_cast<int32_t>(block_hashes_.size());
      expect((i + 1) * block_size <= num_tokens() - num_pending_, "block_hash of a block that is not full and known");
      const uint64_t parent = i == 0 ? kRootBlockHash : block_hashes_.back();
      block_hashes_.push_back(chain_block_hash(parent, &tokens_[i * block_size], block_size, mask));
    }
    return block_hashes_[index];
  }

  bool is_waiting() const { return std::holds_alternative<state::Waiting>(state_); }
  bool is_prefilling() const { return std::holds_alternative<state::Prefilling>(state_); }
  bool is_decoding() const { return std::holds_alternative<state::Decoding>(state_); }
  bool is_finished() const { return std::holds_alternative<state::Finished>(state_); }

  // The blocks of a running (prefilling or decoding) request; null otherwise.
  BlockTable* blocks() {
    if (auto* s = std::get_if<state::Prefilling>(&state_)) return &s->blocks;
    if (auto* s = std::get_if<state::Decoding>(&state_)) return &s->blocks;
    return nullptr;
  }
  const BlockTable* blocks() const { return const_cast<Request*>(this)->blocks(); }

  // Waiting -> Prefilling, taking ownership of its matched prefix blocks (holding
  // its first `num_matched_tokens`, already computed) and those of its first chunk.
  void admit(BlockTable blocks, int32_t num_matched_tokens) {
    expect(is_waiting(), "admit");
    expect(num_matched_tokens < num_tokens(), "admit with every token matched");
    state_ = state::Prefilling{std::move(blocks)};
    num_computed_ = num_matched_tokens;
    if (!was_admitted_) num_cached_tokens_ = num_matched_tokens;
    was_admitted_ = true;
  }

  // Prefilling|Decoding -> Waiting: blocks freed, every known token to recompute.
  void preempt() {
    expect(is_prefilling() || is_decoding(), "preempt");
    state_ = state::Waiting{};
    num_computed_ = 0;
  }

  // A scheduled query of `query_len` tokens went through the model.
  void record_computed(int32_t query_len) {
    expect(is_prefilling() || is_decoding(), "record_computed");
    num_computed_ += query_len;
  }

  // A token was sampled after the last known token; its value comes later (resolve_pending).
  // Prefilling -> Decoding. `sample_index` is its place among its step's sampled tokens.
  void append_pending(int32_t sample_index) {
    expect(num_computed_ == num_tokens(), "append_pending before all tokens were computed");
    if (auto* s = std::get_if<state::Prefilling>(&state_)) {
      state_ = state::Decoding{std::move(s->blocks)};
    }
    expect(is_decoding(), "append_pending");
    tokens_.push_back(kPendingToken);
    ++num_pending_;
    last_sample_index_ = sample_index;
  }

  // The value of the oldest pending token. Returns why the request ends with it: a stop
  // token, or the output reaching max_new_tokens with it; kNone otherwise. The request may
  // have been preempted since (then it is Waiting and recomputes the token later).
  FinishReason resolve_pending(int64_t token) {
    expect(num_pending_ > 0 && token >= 0, "resolve_pending");
    const int32_t position = num_tokens() - num_pending_;
    tokens_[static_cast<size_t>(position)] = token;
    --num_pending_;
    for (int64_t stop : stop_token_ids_) {
      if (stop == token) return FinishReason::kStop;
    }
    if (position + 1 - prompt_len_ >= max_new_tokens_) return FinishReason::kLength;
    return FinishReason::kNone;
  }

  // Sampled tokens whose values are not known yet (at most two: see scheduler.hpp).
  int32_t num_pending() const { return num_pending_; }
  // The newest pending token's index among its step's sampled tokens.
  int32_t last_sample_index() const { return last_sample_index_; }
  // Every output token it may produce is sampled (some maybe pending): nothing left to schedule.
  bool output_complete() const { return output_len() >= max_new_tokens_; }

  // The token sampled after the last known token, known at once: append_pending + resolve_pending.
  FinishReason append_sampled(int64_t token) {
    append_pending(0);
    const FinishReason reason = resolve_pending(token);
    if (reason != FinishReason::kNone) state_ = state::Finished{reason};
    return reason;
  }

  void finish(FinishReason reason) { state_ = state::Finished{reason}; }

  // Speculative decoding: this request may be given drafts (set at add_request).
  bool speculates() const { return speculates_; }
  void set_speculates(bool on) { speculates_ = on; }
  // Back-off while drafts are rejected (scheduler.hpp): steps to skip before drafting again, and
  // consecutive verified steps that kept none.
  bool skip_draft() {
    if (draft_skip_ <= 0) return false;
    --draft_skip_;
    return true;
  }
  int32_t draft_skip() const { return draft_skip_; }
  // Draft tokens a verify step may carry: its draft + 1 tokens never pass max_new_tokens.
  int32_t draft_room() const { return max_new_tokens() - output_len() - 1; }
  void record_verified(int32_t kept_drafts, int32_t max_skip) {
    if (kept_drafts > 0) {
      draft_misses_ = 0;
      return;
    }
    draft_misses_ = std::min(draft_misses_ + 1, 30);
    draft_skip_ = std::min((1 << std::min(draft_misses_, 5)) - 1, max_skip);
  }
  // A drafter's draft for the schedule() numbered `step` (Scheduler::set_draft), used instead of
  // the scheduler's own n-gram draft by that call only.
  void give_draft(const int64_t* tokens, size_t n, uint64_t step) {
    given_draft_.assign(tokens, tokens + n);
    given_step_ = step;
  }
  bool take_given_draft(uint64_t step) {
    if (given_step_ != step) return false;
    draft_.swap(given_draft_);
    given_step_ = 0;
    return true;
  }
  // The tokens proposed to follow the last known one for the step being scheduled.
  std::vector<int64_t>& draft() { return draft_; }
  const std::vector<int64_t>& draft() const { return draft_; }

  // After a verified step: the next of its accepted tokens. The token before it (the step's
  // input at that position) is now computed, and `token` is known at once.
  FinishReason append_accepted(int64_t token) {
    record_computed(1);
    append_pending(0);
    return resolve_pending(token);
  }

 private:
  void expect(bool ok, const char* what) const {
    if (!ok)
      throw std::logic_error(std::string("request ") + std::to_string(id_) +
                             ": illegal transition " + what);
  }

  int64_t id_;
  uint64_t serial_;
  int64_t parent_id_ = -1;
  uint64_t parent_serial_ = 0;
  int32_t prompt_len_;
  int32_t max_new_tokens_;
  int32_t num_computed_ = 0;
  int32_t num_cached_tokens_ = 0;
  int32_t num_pending_ = 0;
  int32_t last_sample_index_ = 0;
  bool was_admitted_ = false;
  bool speculates_ = false;
  int32_t draft_skip_ = 0;
  int32_t draft_misses_ = 0;
  std::vector<int64_t> draft_;
  std::vector<int64_t> given_draft_;
  uint64_t given_step_ = 0;
  std::vector<int64_t> tokens_;
  std::vector<uint64_t> block_hashes_;
  std::vector<int64_t> stop_token_ids_;
  std::variant<state::Waiting, state::Prefilling, state::Decoding, state::Finished> state_;
};

}  // namespace tokenspeed
