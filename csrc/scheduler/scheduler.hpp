// Continuous batching over a paged KV cache: which requests compute which tokens in
// the next step, and into which slots their K/V go.
//
// One step fills in this order:
//   1. every decoding request gets one token (preempting the newest running request,
//      by recompute, when a block boundary needs a block the pool does not have);
//   2. requests mid-prefill continue with their next chunk;
//   3. waiting requests are admitted in FIFO order (no skipping ahead; a sibling whose
//      parent is still waiting or prefilling is passed over, not waited for) while
//      there is room in max_num_seqs, the token budget and the pool.
// schedule() hands out a StepPlan; advance() takes the tokens sampled for it.
//
// Overlap scheduling splits advance() in two, so the host can plan step N+1 while the
// device still runs step N: commit() records the last plan as computed, its sampled
// tokens *pending* (request.hpp), and resolve(sampled) later gives the values of the
// oldest committed step's tokens, in order. schedule() may run while one committed
// step is unresolved: a decode row then computes a pending token, and its input id in
// the plan is -1 - i, meaning "sample i of the previous step" (the model runner reads it
// on the device). A request whose output is complete at commit (max_new_tokens reached)
// is not scheduled again; one that samples a stop token is found at resolve, so it may
// have computed one more token, which is dropped (resolve's `live` flags say which
// sampled tokens belong to requests still alive). Full blocks are registered in the
// prefix cache at resolve, once every token in them is known.
// Protocol: schedule -> commit -> (schedule -> commit ->) resolve -> ... with at most
// two committed steps unresolved; advance() = commit() + resolve() with none pending.
//
// Speculative decoding (num_speculative_tokens > 0): schedule() gives a
// decoding request that speculates a *draft* of up to num_speculative_tokens tokens proposed to
// follow its last one, from its own tokens by n-gram match (ngram_max_match > 0: the longest
// suffix of ngram_min_match..ngram_max_match tokens that occurred before, most recent occurrence
// first, proposes what followed it). Its row then computes 1 + draft tokens (StepPlan::draft_lens)
// and samples at each; resolve_verified() takes the tokens kept (the drafts the sampler agreed
// with and the one sampled after the last of them), counts them as computed, and frees the
// blocks of the rejected drafts' slots. A draft never passes max_new_tokens, and is dropped
// rather than preempting anyone for its blocks. A request with a pending token gets no draft (its
// last token is not known yet), so a caller that overlaps steps resolves the pending step before
// scheduling one that may_draft().
//
// Prefix caching: admission (and re-admission after preemption) first matches the
// longest chain of cached full blocks equal to the request's known tokens, leaving
// at least one token to compute, so a request never writes into a shared block.
// advance() registers every full block whose K/V became computed (prompt and
// output alike). Released registered blocks stay matchable until evicted (LRU);
// free and evictable blocks both count as available for admission and preemption.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <utility>
#include <unordered_map>
#include <vector>

#include "block_allocator.hpp"
#include "request.hpp"

namespace tokenspeed {

struct SchedulerConfig {
  int32_t num_blocks;
  int32_t block_size;
  int32_t max_num_seqs;        // most running (admitted) requests
  int32_t max_model_len;       // prompt + output tokens of one request
  int32_t token_budget;        // tokens computed per step when chunking (--chunked-prefill-size)
  bool chunked_prefill;        // false: prompts are never split
  int32_t max_prefill_tokens;  // prefill tokens per step when not chunking
  bool enable_prefix_caching = true;  // false: only siblings share blocks, nothing is retained
  bool enable_kv_events = false;      // record stored/removed/cleared events for drain_kv_events()
  int32_t hash_bits = 64;             // < 64 only in tests: narrow hashes force collisions
  // > 0: admission keeps room for the running requests' expected output (schedule_admissions,
  // --schedule-conservativeness); 0: a request is admitted whenever its first chunk fits.
  double schedule_conservativeness = 0.0;
  // > 0: every layer of the model attends to the last sliding_window positions only, so a
  // running request's blocks wholly before every future query's window are released.
  int32_t sliding_window = 0;
  // > 0: drafts of at most this many tokens for the requests that speculate (see above).
  int32_t num_speculative_tokens = 0;
  int32_t ngram_min_match = 1;
  int32_t ngram_max_match = 0;  // 0: no n-gram drafts
  // More decoding requests than this in a step: no drafts in it (a large batch is compute-bound
  // enough that verifying drafts costs more than it saves); 0: no limit.
  int32_t max_speculative_batch = 0;
};

// Per request, speculation backs off while its drafts are rejected: after a verified step that
// kept none, it skips 2^misses - 1 steps (at most kSpeculationMaxSkip) before drafting again,
// probing whether its text became predictable.
inline constexpr int32_t kSpeculationMaxSkip = 16;

// The draft n-gram matching proposes for `tokens`: the `max_tokens` tokens that followed the most
// recent earlier occurrence of the longest suffix of min_match..max_match tokens (continued
// periodically where they reach the end: a repeating pattern); empty if none.
void ngram_draft(const std::vector<int64_t>& tokens, int32_t min_match, int32_t max_match, int32_t max_tokens,
                 std::vector<int64_t>& draft);

// Output tokens a request is expected to use at most when reserving room for it: its
// max_new_tokens, clipped here (a client that leaves max_tokens unset asks for the whole context).
inline constexpr int32_t kClipExpectedNewTokens = 4096;
inline int32_t clipped_output_budget(const Request& request) {
  return std::min(request.max_new_tokens(), kClipExpectedNewTokens);
}
// Weight of each finished request in the running mean of the fraction of its (clipped)
// max_new_tokens it used (expected_output_ratio).
inline constexpr double kOutputRatioWeight = 0.05;

// Flat arrays of one step; B rows, T tokens, row-major block tables [B, width].
struct StepPlan {
  std::vector<int64_t> req_ids;
  std::vector<int32_t> query_lens;
  std::vector<int32_t> context_lens;
  std::vector<int64_t> input_ids;
  std::vector<int64_t> positions;
  std::vector<int64_t> slot_mapping;
  std::vector<int32_t> block_tables;
  int32_t block_table_width = 0;
  std::vector<int32_t> sample_rows;
  std::vector<int32_t> draft_lens;  // per row: draft tokens after its first query token (0: none)
};

struct StepOutcome {
  std::vector<int64_t> finished_req_ids;
  std::vector<int32_t> finish_reasons;
  std::vector<uint8_t> live;  // per sampled token: its request is alive (not aborted or finished before)
  // resolve_verified: per sample row, how many of its tokens were kept (up to a stop; 0 when not live).
  std::vector<int32_t> used;
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& config);

  // Throws std::invalid_argument (ValueError) for a request that can never run.
  // wait_for >= 0 makes the request a sibling of that live request (see request.hpp).
  void add_request(int64_t req_id, const int64_t* prompt, size_t prompt_len,
                   int32_t max_new_tokens, const int64_t* stop_token_ids, size_t num_stop,
                   int64_t wait_for = -1, bool speculates = false);
  StepPlan schedule();
  // A draft for `req_id`'s next step, from a drafter outside the scheduler (a draft model; a
  // benchmark's oracle): the next schedule() uses it (clipped as its own) instead of an n-gram
  // draft, if the request decodes and speculates then; otherwise it is dropped.
  void set_draft(int64_t req_id, const int64_t* tokens, size_t n);
  StepOutcome advance(const int64_t* sampled, size_t num_sampled);
  void commit();
  StepOutcome resolve(const int64_t* sampled, size_t num_sampled);
  // resolve() of a step with drafts: sample row i's tokens are the next counts[i] of `sampled`
  // (1 <= counts[i] <= 1 + its draft length), kept in order up to a stop or max_new_tokens.
  StepOutcome resolve_verified(const int64_t* sampled, size_t num_sampled, const int32_t* counts, size_t num_rows);
  // Forgets the scheduled, uncommitted plan after every request in it was aborted (a failed step).
  void drop_plan();
  int32_t num_unresolved() const { return static_cast<int32_t>(pending_.size()); }
  bool abort(int64_t req_id);

  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  // Blocks an allocation can get without preempting anyone: free + evictable.
  int32_t num_free_blocks() const { return allocator_.num_available(); }
  int32_t num_total_blocks() const { return allocator_.num_blocks(); }
  int32_t num_cached_blocks() const { return allocator_.num_cached(); }
  int32_t num_evictable_blocks() const { return allocator_.num_evictable(); }
  int64_t prefix_query_tokens() const { return prefix_query_tokens_; }
  int64_t prefix_hit_tokens() const { return prefix_hit_tokens_; }
  // Whether the next schedule() could give some request a draft if no step were pending: a
  // decoding request that speculates, out of back-off, with room for a draft, in a decoding batch
  // no larger than max_speculative_batch. False: the next step drafts for none, so it can be
  // scheduled while the previous one is unresolved (overlap) at no loss.
  bool may_draft() const;
  // Steps whose decoding batch was too large to draft for (max_speculative_batch).
  int64_t num_undrafted_batches() const { return num_undrafted_batches_; }
  // Request-steps that drafted nothing because the request was backing off after rejected drafts.
  int64_t num_backoff_steps() const { return num_backoff_steps_; }
  // Tokens matched at the first admission; 0 for an unknown id.
  int32_t cached_tokens(int64_t req_id) const;
  int32_t flush_prefix_cache();
  std::vector<KvEvent> drain_kv_events() { return allocator_.drain_events(); }
  const BlockAllocator& allocator() const { return allocator_; }
  int64_t num_used_tokens() const;
  int64_t num_preemptions() const { return num_preemptions_; }
  // The running mean, over finished requests, of the fraction of their clipped max_new_tokens
  // they produced; 1 until one finishes. Admission reserves this fraction, scaled by
  // schedule_conservativeness, of each running request's remaining output.
  double expected_output_ratio() const { return output_ratio_; }
  // Blocks the running requests are expected to need beyond those they hold (0 when off).
  int64_t reserved_blocks() const;
  int64_t waiting_tokens() const;
  // Waiting requests that were preempted (they keep their output and recompute it).
  int32_t num_retracted() const;
  bool has_work() const { return !waiting_.empty() || !running_.empty(); }
  bool contains(int64_t req_id) const { return requests_.count(req_id) != 0; }
  bool plan_outstanding() const { return plan_outstanding_; }
  // Per-request queries; throw std::out_of_range for an unknown id.
  int32_t output_len(int64_t req_id) const;
  const std::vector<int64_t>& token_ids(int64_t req_id) const;
  std::vector<BlockId> block_ids(int64_t req_id) const;
  const SchedulerConfig& config() const { return config_; }

 private:
  struct ScheduledRow {
    Request* request;  // null once aborted between schedule() and advance()
    int32_t query_len;
    bool samples;
    int32_t draft_len = 0;  // of query_len, the draft tokens after the first
  };

  int32_t blocks_for(int64_t num_tokens) const {
    return static_cast<int32_t>((num_tokens + config_.block_size - 1) / config_.block_size);
  }
  // The most blocks a request of `total` tokens holds at once: all of them, or with a sliding
  // window and chunked prefill those of the window before a step's tokens and of the step's (at
  // most token_budget), where fewer. Without chunking a preempted request recomputes all its
  // tokens in one step: all of them.
  int32_t peak_blocks(int64_t total) const {
    const int32_t all = blocks_for(total);
    if (config_.sliding_window <= 0 || !config_.chunked_prefill) return all;
    const int64_t step = std::max<int64_t>(config_.token_budget, 1);
    return std::min(all, blocks_for(config_.sliding_window - 1 + step) + 1);
  }
  const Request& find(int64_t req_id) const;
  void schedule_decodes(std::vector<ScheduledRow>& rows);
  int32_t propose_draft(Request& request);
  int32_t num_decoding() const;  // running requests in their decode phase
  StepOutcome resolve_rows(const int64_t* sampled, size_t num_sampled, const int32_t* counts);
  int32_t schedule_prefill_continuations(std::vector<ScheduledRow>& rows, int32_t budget);
  void schedule_admissions(std::vector<ScheduledRow>& rows, int32_t budget);
  double reserve_ratio() const;
  int32_t expected_growth_blocks(const Request& request, int64_t held_blocks, double ratio) const;
  bool eligible(const Request& request) const;
  Request* live_parent(const Request& request) const;
  int32_t match_prefix(Request& request, std::vector<std::pair<BlockId, uint64_t>>& matched);
  void register_computed_blocks(Request& request);
  void release_slid_out_blocks(Request& request);
  void preempt_newest();
  StepPlan build_plan(const std::vector<ScheduledRow>& rows) const;
  void remove_running(Request* request);
  void forget_in_steps(const Request* request);

  SchedulerConfig config_;
  // Declared first so it is destroyed last, after every request returned its blocks.
  BlockAllocator allocator_;
  std::unordered_map<int64_t, std::unique_ptr<Request>> requests_;
  std::deque<Request*> waiting_;
  std::vector<Request*> running_;  // in admission order: the back is the newest
  std::vector<ScheduledRow> in_flight_;          // scheduled, not committed
  std::deque<std::vector<ScheduledRow>> pending_;  // committed, sampled tokens not resolved (oldest first)
  bool plan_outstanding_ = false;  // a non-empty plan awaits commit()
  bool advance_allowed_ = false;   // schedule() ran and commit() has not consumed it
  int64_t num_preemptions_ = 0;
  int64_t num_undrafted_batches_ = 0;
  int64_t num_backoff_steps_ = 0;
  bool draft_this_step_ = true;
  uint64_t schedule_serial_ = 0;  // schedule() calls so far
  double output_ratio_ = 1.0;
  uint64_t next_request_serial_ = 1;
  uint64_t hash_mask_;
  int64_t prefix_query_tokens_ = 0;
  int64_t prefix_hit_tokens_ = 0;
};

}  // namespace tokenspeed
