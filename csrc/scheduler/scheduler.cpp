// Continuous batching over a paged KV cache; see scheduler.hpp for the step order.
#include "scheduler.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace tokenspeed {

namespace {
void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}
}  // namespace

Scheduler::Scheduler(const SchedulerConfig& config)
    : config_(config),
      allocator_(std::max(config.num_blocks, 1), config.enable_prefix_caching, config.enable_kv_events),
      hash_mask_(config.hash_bits >= 64 ? ~uint64_t{0} : (uint64_t{1} << std::max(config.hash_bits, 1)) - 1) {
  require(config.num_blocks >= 1, "num_blocks must be >= 1");
  require(config.block_size >= 1, "block_size must be >= 1");
  require(config.max_num_seqs >= 1, "max_num_seqs must be >= 1");
  require(config.max_model_len >= 2, "max_model_len must be >= 2");
  require(config.token_budget >= 1, "token_budget must be >= 1");
  require(config.chunked_prefill || config.max_prefill_tokens >= 1,
          "max_prefill_tokens must be >= 1 when chunked prefill is disabled");
  require(config.hash_bits >= 1 && config.hash_bits <= 64, "hash_bits must be in [1, 64]");
  require(config.num_speculative_tokens >= 0, "num_speculative_tokens must be >= 0");
  require(config.ngram_max_match == 0 || (config.ngram_min_match >= 1 && config.ngram_min_match <= config.ngram_max_match),
          "ngram match window sizes must satisfy 1 <= min <= max");
}

void Scheduler::add_request(int64_t req_id, const int64_t* prompt, size_t prompt_len,
                            int32_t max_new_tokens, const int64_t* stop_token_ids,
                            size_t num_stop, int64_t wait_for, bool speculates) {
  const std::string name = "request " + std::to_string(req_id) + ": ";
  require(!contains(req_id), name + "duplicate request id");
  require(wait_for != req_id, name + "cannot wait for itself");
  require(prompt_len >= 1, name + "empty prompt");
  require(max_new_tokens >= 1, name + "max_new_tokens must be >= 1, got " + std::to_string(max_new_tokens));
  const int64_t total = static_cast<int64_t>(prompt_len) + max_new_tokens;
  require(total <= config_.max_model_len,
          name + "prompt (" + std::to_string(prompt_len) + " tokens) + max_new_tokens (" +
              std::to_string(max_new_tokens) + ") exceeds max_model_len " +
              std::to_string(config_.max_model_len));
  const int32_t peak = peak_blocks(total);
  require(peak <= allocator_.num_blocks(),
          name + "prompt + max_new_tokens = " + std::to_string(total) + " tokens need " +
              std::to_string(peak) + " blocks, more than the whole KV pool (" +
              std::to_string(allocator_.num_blocks()) + " blocks of " +
              std::to_string(config_.block_size) + ")");
  auto request = std::make_unique<Request>(
      req_id, next_request_serial_++, std::vector<int64_t>(prompt, prompt + prompt_len), max_new_tokens,
      std::vector<int64_t>(stop_token_ids, stop_token_ids + num_stop));
  // An unknown parent (finished, aborted, never seen) leaves nothing to wait for.
  auto parent = requests_.find(wait_for);
  if (wait_for >= 0 && parent != requests_.end()) request->set_parent(wait_for, parent->second->serial());
  request->set_speculates(speculates && config_.num_speculative_tokens > 0);
  waiting_.push_back(request.get());
  requests_.emplace(req_id, std::move(request));
}

StepPlan Scheduler::schedule() {
  if (plan_outstanding_)
    throw std::runtime_error("schedule() called again before advance() consumed the last plan");
  if (pending_.size() > 1)
    throw std::runtime_error("schedule() called with two committed steps unresolved; resolve() one first");
  std::vector<ScheduledRow> rows;
  rows.reserve(running_.size() + 8);
  const int64_t preemptions_before = num_preemptions_;
  ++schedule_serial_;
  draft_this_step_ = true;
  if (config_.num_speculative_tokens > 0 && config_.max_speculative_batch > 0) {
    draft_this_step_ = num_decoding() <= config_.max_speculative_batch;
    num_undrafted_batches_ += !draft_this_step_;
  }
  schedule_decodes(rows);
  // Decode rows are never starved: they may use up (even exceed) the budget.
  int32_t budget = config_.token_budget;
  for (const ScheduledRow& row : rows) budget -= row.query_len;
  budget = schedule_prefill_continuations(rows, budget);
  // After a preemption the pool is short: admitting now would only thrash.
  if (num_preemptions_ == preemptions_before) schedule_admissions(rows, budget);

  StepPlan plan = build_plan(rows);
  in_flight_ = std::move(rows);
  plan_outstanding_ = !in_flight_.empty();
  advance_allowed_ = true;
  return plan;
}

void Scheduler::schedule_decodes(std::vector<ScheduledRow>& rows) {
  // Victims come from the back (newest), so indices before i are never disturbed.
  for (size_t i = 0; i < running_.size(); ++i) {
    Request* request = running_[i];
    if (!request->is_decoding()) continue;
    int32_t draft_len = propose_draft(*request);
    int32_t needed = blocks_for(request->num_tokens() + draft_len);
    if (draft_len > 0 && request->blocks()->size() + allocator_.num_available() < needed) {
      draft_len = 0;  // a draft never preempts anyone
      needed = blocks_for(request->num_tokens());
    }
    bool preempted_self = false;
    while (request->blocks()->size() + allocator_.num_available() < needed) {
      preempted_self = running_.back() == request;
      preempt_newest();
      if (preempted_self) break;
    }
    if (preempted_self) break;  // it was the newest: nothing after it remains
    request->blocks()->grow_to(needed);
    rows.push_back({request, 1 + draft_len, true, draft_len});
  }
}

int32_t Scheduler::num_decoding() const {
  int32_t decoding = 0;
  for (const Request* request : running_) decoding += request->is_decoding();
  return decoding;
}

bool Scheduler::may_draft() const {
  if (config_.num_speculative_tokens <= 0) return false;
  if (config_.max_speculative_batch > 0 && num_decoding() > config_.max_speculative_batch) return false;
  for (const Request* request : running_)
    if (request->is_decoding() && request->speculates() && request->draft_skip() == 0 && request->draft_room() > 0)
      return true;
  return false;
}

void Scheduler::set_draft(int64_t req_id, const int64_t* tokens, size_t n) {
  auto it = requests_.find(req_id);
  if (it == requests_.end()) throw std::out_of_range("unknown request " + std::to_string(req_id));
  for (size_t i = 0; i < n; ++i) require(tokens[i] >= 0, "set_draft: a negative token id");
  it->second->give_draft(tokens, n, schedule_serial_ + 1);
}

int32_t Scheduler::propose_draft(Request& request) {
  std::vector<int64_t>& draft = request.draft();
  draft.clear();
  // A step that skips counts towards the back-off even when the request's last token is pending
  // (overlapped steps): the back-off is measured in steps.
  if (!request.speculates() || !draft_this_step_) return 0;
  if (request.skip_draft()) {
    ++num_backoff_steps_;
    return 0;
  }
  if (request.num_pending() > 0) return 0;
  const int32_t most = std::min(config_.num_speculative_tokens, request.draft_room());
  if (most <= 0) return 0;
  if (request.take_given_draft(schedule_serial_)) {
    if (static_cast<int32_t>(draft.size()) > most) draft.resize(static_cast<size_t>(most));
  } else if (config_.ngram_max_match > 0)
    ngram_draft(request.tokens(), config_.ngram_min_match, config_.ngram_max_match, most, draft);
  return static_cast<int32_t>(draft.size());
}

// One backward pass: positions holding the last token are candidate match ends, each extended
// backwards while it agrees with the suffix; the first (most recent) of the longest wins. Linear
// in the tokens plus the extensions (at most max_match each). Like vLLM's and SGLang's n-gram
// proposers in what it proposes; no index kept between steps, as one pass costs microseconds
// for the few thousand tokens of a request.
void ngram_draft(const std::vector<int64_t>& tokens, int32_t min_match, int32_t max_match, int32_t max_tokens,
                 std::vector<int64_t>& draft) {
  draft.clear();
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (max_tokens <= 0 || n < 2 || max_match <= 0) return;
  const int64_t longest = std::min<int64_t>(max_match, n - 1);
  const int64_t last = tokens[static_cast<size_t>(n - 1)];
  int64_t best_end = -1;
  int64_t best_len = 0;
  for (int64_t end = n - 2; end >= 0; --end) {
    if (tokens[static_cast<size_t>(end)] != last) continue;
    int64_t len = 1;
    while (len < longest && end - len >= 0 &&
           tokens[static_cast<size_t>(end - len)] == tokens[static_cast<size_t>(n - 1 - len)])
      ++len;
    if (len > best_len) {
      best_len = len;
      best_end = end;
      if (len == longest) break;
    }
  }
  if (best_len < min_match) return;
  // What followed the occurrence; where that runs into the end (an occurrence within the last
  // max_tokens tokens: a repeating pattern), the pattern goes on: the draft continues itself.
  for (int64_t i = 0; i < max_tokens; ++i) {
    const int64_t source = best_end + 1 + i;
    draft.push_back(source < n ? tokens[static_cast<size_t>(source)] : draft[static_cast<size_t>(source - n)]);
  }
}

int32_t Scheduler::schedule_prefill_continuations(std::vector<ScheduledRow>& rows, int32_t budget) {
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Request* request = running_[i];
    if (!request->is_prefilling()) continue;
    const int32_t context = request->num_computed();
    const int32_t block_size = config_.block_size;
    auto capacity = [&] {
      return (request->blocks()->size() + allocator_.num_available()) * block_size - context;
    };
    // Out of blocks: preempt newer prefills, which are not in this plan yet; a
    // decoding request at the back already is, so then wait for decodes to free
    // blocks (or preempt this one). A request admitted behind this one on cached
    // blocks alone can leave it short.
    while (capacity() <= 0 && running_.back() != request && running_.back()->is_prefilling())
      preempt_newest();
    int32_t chunk = std::min({request->num_uncomputed(), budget, capacity()});
    if (!config_.chunked_prefill && chunk < request->num_uncomputed()) chunk = 0;
    if (chunk <= 0) continue;
    request->blocks()->grow_to(blocks_for(context + chunk));
    rows.push_back({request, chunk, chunk == request->num_uncomputed()});
    budget -= chunk;
  }
  return budget;
}

void Scheduler::schedule_admissions(std::vector<ScheduledRow>& rows, int32_t budget) {
  // Nothing to admit (the usual decode step): skip the reservation's pass over the running requests.
  if (waiting_.empty() || num_running() >= config_.max_num_seqs) return;
  const int32_t block_size = config_.block_size;
  const bool reserving = config_.schedule_conservativeness > 0;
  const double ratio = reserving ? reserve_ratio() : 0.0;
  int64_t reserved = reserving ? reserved_blocks() : 0;
  int64_t prefill_tokens = 0;  // computed by admissions this step (whole prompts when not chunking)
  std::vector<std::pair<BlockId, uint64_t>> matched;
  for (auto it = waiting_.begin(); it != waiting_.end() && num_running() < config_.max_num_seqs;) {
    Request* request = *it;
    if (!eligible(*request)) {  // a sibling whose parent has not prefilled: not a blocker
      ++it;
      continue;
    }
    if (config_.chunked_prefill && budget <= 0) break;
    const int32_t num_matched = match_prefix(*request, matched);
    const int32_t matched_tokens = num_matched * block_size;
    const int32_t uncomputed = request->num_tokens() - matched_tokens;
    int32_t chunk;
    if (config_.chunked_prefill) {
      chunk = std::min(uncomputed, budget);
    } else {
      // Whole prompts up to max_prefill_tokens; a larger one still goes alone.
      if (prefill_tokens > 0 && prefill_tokens + uncomputed > config_.max_prefill_tokens) break;
      chunk = uncomputed;
    }
    // Matched evictable blocks count as available but are about to be taken.
    int32_t matched_evictable = 0;
    for (const auto& entry : matched) matched_evictable += allocator_.is_evictable(entry.first);
    const int32_t needed = blocks_for(matched_tokens + chunk) - num_matched;
    if (needed > allocator_.num_available() - matched_evictable) break;
    // Room kept for the expected rest of this request and of every running one; with nothing
    // running the request goes in regardless (it can always finish alone).
    int64_t growth = 0;
    if (reserving) {
      growth = expected_growth_blocks(*request, num_matched + needed, ratio);
      if (!running_.empty() && needed + growth + reserved > allocator_.num_available() - matched_evictable) break;
    }
    BlockTable blocks(allocator_);
    for (const auto& [block, serial] : matched) blocks.append_matched(block, serial);  // before any eviction
    blocks.grow_to(num_matched + needed);
    it = waiting_.erase(it);
    if (!request->was_admitted()) {
      prefix_query_tokens_ += request->prompt_len();
      prefix_hit_tokens_ += matched_tokens;
    }
    request->admit(std::move(blocks), matched_tokens);
    release_slid_out_blocks(*request);  // matched blocks before its first chunk's window: not held
    running_.push_back(request);
    rows.push_back({request, chunk, chunk == uncomputed});
    budget -= chunk;
    prefill_tokens += chunk;
    reserved += growth;
  }
}

// Why reserve: admitting whenever a prompt fits fills the pool with requests whose outputs
// cannot all grow to their end; the newest are then preempted and later recompute their prompt
// and output, which costs more than the room kept here.
// SGLang keeps room the same way, with a ratio that decays over steps (new_token_ratio); here
// the ratio is learned from what finished requests really produced, so requests that stop early
// (the usual chat case) soon reserve little and ignore_eos runs reserve all they will use.
double Scheduler::reserve_ratio() const {
  return std::min(1.0, config_.schedule_conservativeness * output_ratio_);
}

int32_t Scheduler::expected_growth_blocks(const Request& request, int64_t held_blocks, double ratio) const {
  const int32_t remaining = std::max(0, clipped_output_budget(request) - request.output_len());
  const int64_t target = request.num_tokens() + static_cast<int64_t>(std::ceil(ratio * remaining));
  // With a sliding window a request never holds more than its peak (released blocks not held).
  const int64_t at_most = peak_blocks(target);
  return static_cast<int32_t>(std::max<int64_t>(0, at_most - held_blocks));
}

int64_t Scheduler::reserved_blocks() const {
  if (config_.schedule_conservativeness <= 0) return 0;
  const double ratio = reserve_ratio();
  int64_t reserved = 0;
  for (const Request* request : running_)
    reserved += expected_growth_blocks(
        *request, static_cast<int64_t>(request->blocks()->size() - request->blocks()->num_released()), ratio);
  return reserved;
}

bool Scheduler::eligible(const Request& request) const {
  if (request.parent_id() < 0) return true;
  auto it = requests_.find(request.parent_id());
  if (it == requests_.end() || it->second->serial() != request.parent_serial()) return true;
  return !(it->second->is_waiting() || it->second->is_prefilling());
}

Request* Scheduler::live_parent(const Request& request) const {
  if (request.parent_id() < 0) return nullptr;
  auto it = requests_.find(request.parent_id());
  if (it == requests_.end() || it->second->serial() != request.parent_serial()) return nullptr;
  return it->second->blocks() ? it->second.get() : nullptr;
}

// The longest run of leading full blocks whose K/V already exists: cached blocks
// (when caching is on) or, for a sibling, its live parent's computed blocks. At
// least one token is left to compute. Fills `matched` with (block, serial).
int32_t Scheduler::match_prefix(Request& request, std::vector<std::pair<BlockId, uint64_t>>& matched) {
  matched.clear();
  const int32_t block_size = config_.block_size;
  const int32_t max_blocks = (request.num_tokens() - 1) / block_size;
  const Request* parent = live_parent(request);
  const int32_t parent_blocks = parent ? parent->num_computed() / block_size : 0;
  bool parent_agrees = parent != nullptr;  // the parent's tokens equal ours so far
  uint64_t parent_serial = kRootSerial;
  for (int32_t i = 0; i < max_blocks; ++i) {
    const int64_t* tokens = request.tokens().data() + static_cast<size_t>(i) * block_size;
    parent_agrees = parent_agrees && i < parent_blocks &&
                    std::equal(tokens, tokens + block_size, parent->tokens().data() + static_cast<size_t>(i) * block_size);
    BlockId block = -1;
    uint64_t serial = kNoSerial;
    if (config_.enable_prefix_caching) {
      block = allocator_.lookup(request.block_hash(i, block_size, hash_mask_), parent_serial, tokens, block_size);
      if (block >= 0) serial = allocator_.serial(block);
    }
    if (block < 0 && parent_agrees) {
      block = parent->blocks()->ids()[i];
      const std::vector<uint64_t>& chain = parent->blocks()->chain();
      serial = static_cast<size_t>(i) < chain.size() ? chain[i] : kNoSerial;
    }
    if (block < 0) break;
    matched.emplace_back(block, serial);
    parent_serial = serial;
  }
  return static_cast<int32_t>(matched.size());
}

// Registers each full block whose K/V is now computed, in sequence order, so the
// chain's parent is always registered first.
void Scheduler::register_computed_blocks(Request& request) {
  BlockTable* table = request.blocks();
  const int32_t block_size = config_.block_size;
  const size_t num_full = static_cast<size_t>(request.num_computed() / block_size);
  while (!table->chain_broken() && table->chain().size() < num_full) {
    const int32_t i = static_cast<int32_t>(table->chain().size());
    const uint64_t hash = request.block_hash(i, block_size, hash_mask_);
    const uint64_t parent_hash = i > 0 ? request.block_hash(i - 1, block_size, hash_mask_) : 0;
    const uint64_t parent_serial = i > 0 ? table->chain()[i - 1] : kRootSerial;
    table->extend_chain(allocator_.register_block(table->ids()[i], hash, i > 0 ? &parent_hash : nullptr,
                                                  parent_serial,
                                                  request.tokens().data() + static_cast<size_t>(i) * block_size,
                                                  block_size));
  }
}

// With a sliding window on every layer, a query at position p reads keys (p - window, p]. Every
// query still to come sits at num_computed or later, so the blocks wholly before
// num_computed - window + 1 are never read again: released (registered ones stay in the prefix
// cache, matchable, as a finished request's do). Steps already planned may still read them: they
// run first on the device, before any later step writes a block this frees.
void Scheduler::release_slid_out_blocks(Request& request) {
  const int32_t window = config_.sliding_window;
  if (window <= 0) return;
  const int32_t first_needed = request.num_computed() - window + 1;
  if (first_needed <= 0) return;
  request.blocks()->release_before(first_needed / config_.block_size);
}

void Scheduler::preempt_newest() {
  Request* victim = running_.back();
  running_.pop_back();
  victim->preempt();
  waiting_.push_front(victim);
  ++num_preemptions_;
}

StepPlan Scheduler::build_plan(const std::vector<ScheduledRow>& rows) const {
  StepPlan plan;
  const size_t num_rows = rows.size();
  size_t num_tokens = 0;
  int32_t width = 1;
  for (const ScheduledRow& row : rows) {
    num_tokens += row.query_len;
    width = std::max(width, row.request->blocks()->size());
  }
  plan.req_ids.reserve(num_rows);
  plan.query_lens.reserve(num_rows);
  plan.context_lens.reserve(num_rows);
  plan.input_ids.reserve(num_tokens);
  plan.positions.reserve(num_tokens);
  plan.slot_mapping.reserve(num_tokens);
  plan.block_tables.assign(num_rows * width, 0);
  plan.block_table_width = width;
  plan.draft_lens.reserve(num_rows);

  const int64_t block_size = config_.block_size;
  for (size_t b = 0; b < num_rows; ++b) {
    const Request& request = *rows[b].request;
    const std::vector<BlockId>& blocks = request.blocks()->ids();
    const int32_t context = request.num_computed();
    plan.req_ids.push_back(request.id());
    plan.query_lens.push_back(rows[b].query_len);
    plan.context_lens.push_back(context);
    const int32_t known = request.num_tokens();
    for (int32_t pos = context; pos < context + rows[b].query_len; ++pos) {
      // Past the known tokens: the row's draft (schedule_decodes).
      int64_t token = pos < known ? request.tokens()[pos] : request.draft()[static_cast<size_t>(pos - known)];
      // A pending token (only ever the newest, of the one unresolved step): read on the device.
      if (token == kPendingToken) token = -1 - static_cast<int64_t>(request.last_sample_index());
      plan.input_ids.push_back(token);
      plan.positions.push_back(pos);
      plan.slot_mapping.push_back(blocks[pos / block_size] * block_size + pos % block_size);
    }
    std::replace_copy(blocks.begin(), blocks.end(), plan.block_tables.begin() + b * width, kReleasedBlock, 0);
    if (rows[b].samples) plan.sample_rows.push_back(static_cast<int32_t>(b));
    plan.draft_lens.push_back(rows[b].draft_len);
  }
  return plan;
}

StepOutcome Scheduler::advance(const int64_t* sampled, size_t num_sampled) {
  if (!pending_.empty())
    throw std::runtime_error("advance() called with committed steps unresolved; use resolve()");
  if (!advance_allowed_)
    throw std::runtime_error("advance() called without a plan to consume; call schedule() first");
  size_t num_sampling = 0;
  for (const ScheduledRow& row : in_flight_) num_sampling += row.samples;
  if (num_sampled != num_sampling)
    throw std::invalid_argument("advance() got " + std::to_string(num_sampled) +
                                " sampled tokens, the plan has " + std::to_string(num_sampling) +
                                " sample rows");
  commit();
  if (pending_.empty()) return StepOutcome{};
  return resolve(sampled, num_sampled);
}

void Scheduler::commit() {
  if (!advance_allowed_)
    throw std::runtime_error("commit() called without a plan to consume; call schedule() first");
  int32_t sample_index = 0;
  for (ScheduledRow& row : in_flight_) {
    const int32_t index = row.samples ? sample_index++ : -1;
    Request* request = row.request;
    if (request == nullptr) continue;  // aborted after schedule()
    // A draft's tokens count as computed only once accepted (resolve_verified).
    request->record_computed(row.draft_len > 0 ? 1 : row.query_len);
    if (!row.samples) continue;
    request->append_pending(index);
    // Every output token is sampled: it only waits for resolve() now, and holds its blocks until then.
    if (request->output_complete()) remove_running(request);
  }
  if (!in_flight_.empty()) pending_.push_back(std::move(in_flight_));
  in_flight_.clear();
  plan_outstanding_ = false;
  advance_allowed_ = false;
}

StepOutcome Scheduler::resolve(const int64_t* sampled, size_t num_sampled) {
  if (pending_.empty()) throw std::runtime_error("resolve() called with no committed step unresolved");
  size_t num_sampling = 0;
  for (const ScheduledRow& row : pending_.front()) {
    num_sampling += row.samples;
    if (row.draft_len > 0) throw std::runtime_error("resolve() of a step with drafts; use resolve_verified()");
  }
  if (num_sampled != num_sampling)
    throw std::invalid_argument("resolve() got " + std::to_string(num_sampled) +
                                " sampled tokens, the step has " + std::to_string(num_sampling) +
                                " sample rows");
  return resolve_rows(sampled, num_sampled, nullptr);
}

StepOutcome Scheduler::resolve_verified(const int64_t* sampled, size_t num_sampled, const int32_t* counts,
                                        size_t num_rows) {
  if (pending_.empty()) throw std::runtime_error("resolve_verified() called with no committed step unresolved");
  size_t row_index = 0;
  size_t total = 0;
  for (const ScheduledRow& row : pending_.front()) {
    if (!row.samples) continue;
    if (row_index >= num_rows) break;
    const int32_t count = counts[row_index++];
    if (count < 1 || count > 1 + row.draft_len)
      throw std::invalid_argument("resolve_verified(): sample row " + std::to_string(row_index - 1) + " kept " +
                                  std::to_string(count) + " tokens, outside [1, 1 + its draft of " +
                                  std::to_string(row.draft_len) + "]");
    total += static_cast<size_t>(count);
  }
  size_t num_sampling = 0;
  for (const ScheduledRow& row : pending_.front()) num_sampling += row.samples;
  if (num_rows != num_sampling)
    throw std::invalid_argument("resolve_verified() got counts for " + std::to_string(num_rows) +
                                " rows, the step has " + std::to_string(num_sampling) + " sample rows");
  if (num_sampled != total)
    throw std::invalid_argument("resolve_verified() got " + std::to_string(num_sampled) +
                                " tokens, the counts add up to " + std::to_string(total));
  return resolve_rows(sampled, num_sampled, counts);
}

StepOutcome Scheduler::resolve_rows(const int64_t* sampled, size_t num_sampled, const int32_t* counts) {
  for (size_t i = 0; i < num_sampled; ++i) {
    if (sampled[i] < 0) throw std::invalid_argument("resolve() got a negative token id");
  }
  std::vector<ScheduledRow> rows = std::move(pending_.front());
  pending_.pop_front();
  StepOutcome outcome;
  size_t next_sample = 0;
  size_t sample_row = 0;
  for (const ScheduledRow& row : rows) {
    const int32_t count = !row.samples ? 0 : counts != nullptr ? counts[sample_row] : 1;
    const int64_t* tokens = sampled + next_sample;
    next_sample += static_cast<size_t>(count);
    Request* request = row.request;
    if (row.samples) {
      ++sample_row;
      outcome.live.push_back(request != nullptr);
      outcome.used.push_back(0);
    }
    if (request == nullptr) continue;  // aborted, or finished by an earlier step: its tokens are dropped
    FinishReason reason = FinishReason::kNone;
    if (row.samples) {
      reason = request->resolve_pending(tokens[0]);
      int32_t used = 1;
      while (reason == FinishReason::kNone && used < count) reason = request->append_accepted(tokens[used++]);
      outcome.used.back() = used;
      if (row.draft_len > 0) request->record_verified(count - 1, kSpeculationMaxSkip);
    }
    if (request->blocks() != nullptr) {
      // The slots past the known tokens held rejected drafts: their blocks go back.
      if (row.draft_len > 0) request->blocks()->shrink_to(blocks_for(request->num_tokens()));
      register_computed_blocks(*request);  // first: registration reads the blocks' ids
      release_slid_out_blocks(*request);
    }
    if (reason == FinishReason::kNone) continue;
    outcome.finished_req_ids.push_back(request->id());
    outcome.finish_reasons.push_back(static_cast<int32_t>(reason));
    const double used = std::min(1.0, static_cast<double>(request->output_len()) / clipped_output_budget(*request));
    output_ratio_ += kOutputRatioWeight * (used - output_ratio_);
    request->finish(reason);
    auto waiting = std::find(waiting_.begin(), waiting_.end(), request);  // preempted since commit
    if (waiting != waiting_.end()) waiting_.erase(waiting);
    remove_running(request);
    forget_in_steps(request);
    requests_.erase(request->id());
  }
  return outcome;
}

void Scheduler::drop_plan() {
  for (const ScheduledRow& row : in_flight_) {
    if (row.request != nullptr) throw std::runtime_error("drop_plan() with live requests in the plan; abort them first");
  }
  in_flight_.clear();
  plan_outstanding_ = false;
  advance_allowed_ = false;
}

void Scheduler::forget_in_steps(const Request* request) {
  for (ScheduledRow& row : in_flight_) {
    if (row.request == request) row.request = nullptr;
  }
  for (auto& step : pending_) {
    for (ScheduledRow& row : step) {
      if (row.request == request) row.request = nullptr;
    }
  }
}

bool Scheduler::abort(int64_t req_id) {
  auto it = requests_.find(req_id);
  if (it == requests_.end()) return false;
  Request* request = it->second.get();
  forget_in_steps(request);
  if (request->is_waiting()) {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), request));
  } else {
    remove_running(request);
  }
  requests_.erase(it);  // destroys the request, and with it its blocks
  return true;
}

void Scheduler::remove_running(Request* request) {
  // Absent when its output completed at commit (it waits for resolve outside running_).
  auto it = std::find(running_.begin(), running_.end(), request);
  if (it != running_.end()) running_.erase(it);
}

int32_t Scheduler::cached_tokens(int64_t req_id) const {
  auto it = requests_.find(req_id);
  return it == requests_.end() ? 0 : it->second->num_cached_tokens();
}

int32_t Scheduler::flush_prefix_cache() {
  // Blocks the running requests hold stay theirs; their chains stop, since blocks
  // registered after a flush could never be reached from an unregistered parent.
  for (Request* request : running_) request->blocks()->break_chain();
  return allocator_.flush();
}

int64_t Scheduler::num_used_tokens() const {
  // Each running request's computed tokens, less the positions of the blocks it released (sliding
  // window): the KV it holds, which is what the loads report to routers.
  int64_t used = 0;
  for (const Request* request : running_) {
    const int64_t released = static_cast<int64_t>(request->blocks()->num_released()) * config_.block_size;
    used += std::max<int64_t>(0, request->num_computed() - released);
  }
  return used;
}

int64_t Scheduler::waiting_tokens() const {
  int64_t tokens = 0;
  for (const Request* request : waiting_) tokens += request->num_uncomputed();
  return tokens;
}

int32_t Scheduler::num_retracted() const {
  int32_t count = 0;
  for (const Request* request : waiting_) count += request->output_len() > 0 ? 1 : 0;
  return count;
}

const Request& Scheduler::find(int64_t req_id) const {
  auto it = requests_.find(req_id);
  if (it == requests_.end()) throw std::out_of_range("unknown request " + std::to_string(req_id));
  return *it->second;
}

int32_t Scheduler::output_len(int64_t req_id) const { return find(req_id).output_len(); }

const std::vector<int64_t>& Scheduler::token_ids(int64_t req_id) const { return find(req_id).tokens(); }

std::vector<BlockId> Scheduler::block_ids(int64_t req_id) const {
  const BlockTable* blocks = find(req_id).blocks();
  return blocks ? blocks->ids() : std::vector<BlockId>{};
}

}  // namespace tokenspeed
