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
// of them are in the KV cache (the *context*). A preempted request keeps its output
// and recomputes all its tokens as if they were its prompt.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "block_allocator.hpp"

namespace tokenspeed {

enum class FinishReason : int32_t { kNone = 0, kStop = 1, kLength = 2 };

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
  Request(int64_t id, std::vector<int64_t> prompt, int32_t max_new_tokens,
          std::vector<int64_t> stop_token_ids)
      : id_(id),
        prompt_len_(static_cast<int32_t>(prompt.size())),
        max_new_tokens_(max_new_tokens),
        tokens_(std::move(prompt)),
        stop_token_ids_(std::move(stop_token_ids)),
        state_(state::Waiting{}) {
    tokens_.reserve(tokens_.size() + max_new_tokens);
  }

  int64_t id() const { return id_; }
  int32_t prompt_len() const { return prompt_len_; }
  int32_t num_tokens() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t output_len() const { return num_tokens() - prompt_len_; }
  int32_t num_computed() const { return num_computed_; }
  int32_t num_uncomputed() const { return num_tokens() - num_computed_; }
  const std::vector<int64_t>& tokens() const { return tokens_; }

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

  // Waiting -> Prefilling, taking ownership of the blocks of its first chunk.
  void admit(BlockTable blocks) {
    expect(is_waiting(), "admit");
    state_ = state::Prefilling{std::move(blocks)};
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

  // The token sampled after the last known token. Prefilling -> Decoding, and
  // -> Finished when it is a stop token or the output reached max_new_tokens.
  FinishReason append_sampled(int64_t token) {
    expect(num_computed_ == num_tokens(), "append_sampled before all tokens were computed");
    if (auto* s = std::get_if<state::Prefilling>(&state_)) {
      state_ = state::Decoding{std::move(s->blocks)};
    }
    expect(is_decoding(), "append_sampled");
    tokens_.push_back(token);
    FinishReason reason = FinishReason::kNone;
    for (int64_t stop : stop_token_ids_) {
      if (stop == token) reason = FinishReason::kStop;
    }
    if (reason == FinishReason::kNone && output_len() >= max_new_tokens_) reason = FinishReason::kLength;
    if (reason != FinishReason::kNone) state_ = state::Finished{reason};
    return reason;
  }

 private:
  void expect(bool ok, const char* what) const {
    if (!ok)
      throw std::logic_error(std::string("request ") + std::to_string(id_) +
                             ": illegal transition " + what);
  }

  int64_t id_;
  int32_t prompt_len_;
  int32_t max_new_tokens_;
  int32_t num_computed_ = 0;
  std::vector<int64_t> tokens_;
  std::vector<int64_t> stop_token_ids_;
  std::variant<state::Waiting, state::Prefilling, state::Decoding, state::Finished> state_;
};

}  // namespace tokenspeed
