// Python bindings of the scheduler core: numpy arrays in and out, no per-request
// Python objects. Step arrays are C++ vectors handed to numpy without a copy.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "block_allocator.hpp"
#include "block_hash.hpp"
#include "kv_event_wire.hpp"
#include "scheduler.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace tokenspeed {
namespace {

template <typename T>
using InArray1D = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// Moves the vector onto the heap; the numpy array's capsule deletes it.
template <typename T>
nb::object to_numpy(std::vector<T>&& values, size_t rows, size_t cols = 0) {
  auto* owned = new std::vector<T>(std::move(values));
  if (owned->empty()) owned->reserve(1);  // a non-null data pointer even for [0]
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  if (cols == 0) return nb::cast(nb::ndarray<nb::numpy, T, nb::ndim<1>>(owned->data(), {rows}, owner));
  return nb::cast(nb::ndarray<nb::numpy, T, nb::ndim<2>>(owned->data(), {rows, cols}, owner));
}

void add_request(Scheduler& self, int64_t req_id, InArray1D<int64_t> prompt, int32_t max_new_tokens,
                 InArray1D<int64_t> stop_token_ids, int64_t wait_for, bool speculates) {
  self.add_request(req_id, prompt.data(), prompt.shape(0), max_new_tokens, stop_token_ids.data(),
                   stop_token_ids.shape(0), wait_for, speculates);
}

// The n-gram draft of `tokens` (scheduler.hpp), for tests.
nb::object ngram_draft_of(InArray1D<int64_t> tokens, int32_t min_match, int32_t max_match, int32_t max_tokens) {
  std::vector<int64_t> all(tokens.data(), tokens.data() + tokens.shape(0));
  std::vector<int64_t> draft;
  ngram_draft(all, min_match, max_match, max_tokens, draft);
  const size_t n = draft.size();
  return to_numpy(std::move(draft), n);
}

// Hashes cross as signed int64, the proto's type: the same 64 bits.
int64_t as_signed(uint64_t hash) { return static_cast<int64_t>(hash); }

nb::list drain_kv_events(Scheduler& self) {
  nb::list out;
  for (KvEvent& event : self.drain_kv_events()) {
    switch (event.kind) {
      case KvEvent::Kind::kStored: {
        nb::list tokens;
        for (int64_t t : event.token_ids) tokens.append(t);
        nb::object parent = event.has_parent ? nb::cast(as_signed(event.parent_hash)) : nb::none();
        out.append(nb::make_tuple("stored", as_signed(event.block_hash), parent, tokens,
                                  static_cast<int32_t>(event.token_ids.size())));
        break;
      }
      case KvEvent::Kind::kRemoved:
        out.append(nb::make_tuple("removed", as_signed(event.block_hash)));
        break;
      case KvEvent::Kind::kCleared:
        out.append(nb::make_tuple("cleared"));
        break;
    }
  }
  return out;
}

// The recorded events as KvEventBatch wire bytes (kv_event_wire.hpp) and how many KvCacheEvents they hold.
nb::tuple drain_kv_events_wire(Scheduler& self, uint64_t first_event_id, uint64_t id_stride) {
  KvEventWire encoded = encode_kv_events(self.drain_kv_events(), first_event_id, id_stride);
  return nb::make_tuple(nb::bytes(encoded.bytes.data(), encoded.bytes.size()), encoded.count);
}

nb::object cached_tokens(const Scheduler& self, InArray1D<int64_t> req_ids) {
  const size_t n = req_ids.shape(0);
  std::vector<int32_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = self.cached_tokens(req_ids.data()[i]);
  return to_numpy(std::move(out), n);
}

// Per block: (ref_counts, evictable, registered) int32 arrays, for invariant tests.
nb::tuple debug_blocks(const Scheduler& self) {
  const BlockAllocator& pool = self.allocator();
  const size_t n = static_cast<size_t>(pool.num_blocks());
  std::vector<int32_t> refs(n), evictable(n), registered(n);
  for (size_t b = 0; b < n; ++b) {
    refs[b] = pool.ref_count(static_cast<BlockId>(b));
    evictable[b] = pool.is_evictable(static_cast<BlockId>(b));
    registered[b] = pool.is_registered(static_cast<BlockId>(b));
  }
  return nb::make_tuple(to_numpy(std::move(refs), n), to_numpy(std::move(evictable), n),
                        to_numpy(std::move(registered), n));
}

// A registered block's (hash, parent hash or None, tokens); None if unregistered.
nb::object debug_cached_block(const Scheduler& self, BlockId block) {
  const CachedBlockInfo& info = self.allocator().cached_info(block);
  if (info.serial == kNoSerial) return nb::none();
  std::vector<int64_t> tokens = info.tokens;
  const size_t n = tokens.size();
  nb::object parent = info.has_parent ? nb::cast(as_signed(info.parent_hash)) : nb::none();
  return nb::make_tuple(as_signed(info.hash), parent, to_numpy(std::move(tokens), n));
}

// None when nothing runs; otherwise the SchedulePlan fields in declaration order.
nb::object schedule(Scheduler& self) {
  StepPlan plan = self.schedule();
  const size_t rows = plan.req_ids.size();
  if (rows == 0) return nb::none();
  const size_t tokens = plan.input_ids.size();
  const size_t samples = plan.sample_rows.size();
  return nb::make_tuple(to_numpy(std::move(plan.req_ids), rows),
                        to_numpy(std::move(plan.query_lens), rows),
                        to_numpy(std::move(plan.context_lens), rows),
                        to_numpy(std::move(plan.input_ids), tokens),
                        to_numpy(std::move(plan.positions), tokens),
                        to_numpy(std::move(plan.slot_mapping), tokens),
                        to_numpy(std::move(plan.block_tables), rows, plan.block_table_width),
                        to_numpy(std::move(plan.sample_rows), samples),
                        to_numpy(std::move(plan.draft_lens), rows));
}

nb::tuple advance(Scheduler& self, InArray1D<int64_t> sampled) {
  StepOutcome outcome = self.advance(sampled.data(), sampled.shape(0));
  const size_t finished = outcome.finished_req_ids.size();
  return nb::make_tuple(to_numpy(std::move(outcome.finished_req_ids), finished),
                        to_numpy(std::move(outcome.finish_reasons), finished));
}

nb::tuple resolve(Scheduler& self, InArray1D<int64_t> sampled) {
  StepOutcome outcome = self.resolve(sampled.data(), sampled.shape(0));
  const size_t finished = outcome.finished_req_ids.size();
  const size_t samples = outcome.live.size();
  return nb::make_tuple(to_numpy(std::move(outcome.finished_req_ids), finished),
                        to_numpy(std::move(outcome.finish_reasons), finished),
                        to_numpy(std::move(outcome.live), samples));
}

nb::tuple resolve_verified(Scheduler& self, InArray1D<int64_t> sampled, InArray1D<int32_t> counts) {
  StepOutcome outcome = self.resolve_verified(sampled.data(), sampled.shape(0), counts.data(), counts.shape(0));
  const size_t finished = outcome.finished_req_ids.size();
  const size_t rows = outcome.live.size();
  return nb::make_tuple(to_numpy(std::move(outcome.finished_req_ids), finished),
                        to_numpy(std::move(outcome.finish_reasons), finished),
                        to_numpy(std::move(outcome.live), rows), to_numpy(std::move(outcome.used), rows));
}

template <typename F>
auto known(const Scheduler& self, int64_t req_id, F&& query) {
  if (!self.contains(req_id)) throw nb::key_error(("unknown request " + std::to_string(req_id)).c_str());
  return query();
}

}  // namespace
}  // namespace tokenspeed

NB_MODULE(_scheduler_core, m) {
  using namespace tokenspeed;
  m.doc() = "Native scheduler core of tokenspeed-worker (request states, chunked prefill, "
            "paged KV block allocator, preemption by recompute).";

  nb::class_<Scheduler>(m, "SchedulerCore")
      .def(
          "__init__",
          [](Scheduler* self, int32_t num_blocks, int32_t block_size, int32_t max_num_seqs,
             int32_t max_model_len, int32_t token_budget, bool chunked_prefill,
             int32_t max_prefill_tokens, bool enable_prefix_caching, bool enable_kv_events, int32_t hash_bits,
             double schedule_conservativeness, int32_t sliding_window, int32_t num_speculative_tokens,
             int32_t ngram_min_match, int32_t ngram_max_match, int32_t max_speculative_batch) {
            if (!(schedule_conservativeness >= 0))
              throw std::invalid_argument("schedule_conservativeness must be >= 0");
            if (sliding_window < 0) throw std::invalid_argument("sliding_window must be >= 0");
            new (self) Scheduler(SchedulerConfig{num_blocks, block_size, max_num_seqs, max_model_len, token_budget,
                                                 chunked_prefill, max_prefill_tokens, enable_prefix_caching,
                                                 enable_kv_events, hash_bits, schedule_conservativeness,
                                                 sliding_window, num_speculative_tokens, ngram_min_match,
                                                 ngram_max_match, max_speculative_batch});
          },
          "num_blocks"_a, "block_size"_a, "max_num_seqs"_a, "max_model_len"_a, "token_budget"_a,
          "chunked_prefill"_a, "max_prefill_tokens"_a, "enable_prefix_caching"_a = true,
          "enable_kv_events"_a = false, "hash_bits"_a = 64, "schedule_conservativeness"_a = 0.0,
          "sliding_window"_a = 0, "num_speculative_tokens"_a = 0, "ngram_min_match"_a = 1,
          "ngram_max_match"_a = 0, "max_speculative_batch"_a = 0)
      .def("add_request", &add_request, "req_id"_a, "prompt_ids"_a, "max_new_tokens"_a, "stop_token_ids"_a,
           "wait_for"_a = -1, "speculates"_a = false)
      .def("schedule", &schedule)
      .def("advance", &advance, "sampled"_a)
      .def("commit", &Scheduler::commit)
      .def("resolve", &resolve, "sampled"_a)
      .def("resolve_verified", &resolve_verified, "sampled"_a, "counts"_a)
      .def("set_draft", [](Scheduler& self, int64_t req_id, InArray1D<int64_t> tokens) {
        self.set_draft(req_id, tokens.data(), tokens.shape(0));
      }, "req_id"_a, "tokens"_a)
      .def("drop_plan", &Scheduler::drop_plan)
      .def_prop_ro("num_unresolved", &Scheduler::num_unresolved)
      .def("abort", &Scheduler::abort, "req_id"_a)
      .def_prop_ro("num_waiting", &Scheduler::num_waiting)
      .def_prop_ro("num_running", &Scheduler::num_running)
      .def_prop_ro("num_free_blocks", &Scheduler::num_free_blocks)
      .def_prop_ro("num_total_blocks", &Scheduler::num_total_blocks)
      .def_prop_ro("num_used_tokens", &Scheduler::num_used_tokens)
      .def_prop_ro("num_preemptions", &Scheduler::num_preemptions)
      .def_prop_ro("expected_output_ratio", &Scheduler::expected_output_ratio)
      .def_prop_ro("reserved_blocks", &Scheduler::reserved_blocks)
      .def_prop_ro("waiting_tokens", &Scheduler::waiting_tokens)
      .def_prop_ro("num_retracted", &Scheduler::num_retracted)
      .def_prop_ro("plan_outstanding", &Scheduler::plan_outstanding)
      .def_prop_ro("num_cached_blocks", &Scheduler::num_cached_blocks)
      .def_prop_ro("num_evictable_blocks", &Scheduler::num_evictable_blocks)
      .def_prop_ro("prefix_query_tokens", &Scheduler::prefix_query_tokens)
      .def_prop_ro("prefix_hit_tokens", &Scheduler::prefix_hit_tokens)
      .def("may_draft", &Scheduler::may_draft)
      .def_prop_ro("num_undrafted_batches", &Scheduler::num_undrafted_batches)
      .def_prop_ro("num_backoff_steps", &Scheduler::num_backoff_steps)
      .def("cached_tokens", &cached_tokens, "req_ids"_a)
      .def("flush_prefix_cache", &Scheduler::flush_prefix_cache)
      .def("drain_kv_events", &drain_kv_events)
      .def("drain_kv_events_wire", &drain_kv_events_wire, "first_event_id"_a, "id_stride"_a)
      .def("debug_blocks", &debug_blocks)
      .def("debug_cached_block", &debug_cached_block, "block"_a)
      .def("has_work", &Scheduler::has_work)
      .def("contains", &Scheduler::contains, "req_id"_a)
      .def("output_len", [](const Scheduler& self, int64_t req_id) {
        return known(self, req_id, [&] { return self.output_len(req_id); });
      })
      .def("token_ids", [](const Scheduler& self, int64_t req_id) {
        return known(self, req_id, [&] {
          std::vector<int64_t> tokens = self.token_ids(req_id);
          const size_t n = tokens.size();
          return to_numpy(std::move(tokens), n);
        });
      })
      .def("block_ids", [](const Scheduler& self, int64_t req_id) {
        return known(self, req_id, [&] {
          std::vector<BlockId> blocks = self.block_ids(req_id);
          const size_t n = blocks.size();
          return to_numpy(std::move(blocks), n);
        });
      });

  // The bare pool, exposed so tests can prove its misuse checks.
  m.def("ngram_draft", &ngram_draft_of, "tokens"_a, "min_match"_a, "max_match"_a, "max_tokens"_a);

  nb::class_<BlockAllocator>(m, "BlockAllocator")
      .def(nb::init<int32_t>(), "num_blocks"_a)
      .def_prop_ro("num_blocks", &BlockAllocator::num_blocks)
      .def_prop_ro("num_free", &BlockAllocator::num_free)
      .def("allocate", &BlockAllocator::allocate)
      .def("share", &BlockAllocator::share, "block"_a)
      .def("release", &BlockAllocator::release, "block"_a)
      .def("ref_count", &BlockAllocator::ref_count, "block"_a);

  m.def(
      "block_hash",
      [](nb::object parent_hash, InArray1D<int64_t> tokens, int32_t hash_bits) {
        const uint64_t parent = parent_hash.is_none() ? kRootBlockHash
                                                      : static_cast<uint64_t>(nb::cast<int64_t>(parent_hash));
        const uint64_t mask = hash_bits >= 64 ? ~uint64_t{0} : (uint64_t{1} << hash_bits) - 1;
        return as_signed(chain_block_hash(parent, tokens.data(), static_cast<int32_t>(tokens.shape(0)), mask));
      },
      "parent_hash"_a.none(), "tokens"_a, "hash_bits"_a = 64,
      "Chain hash of one block (signed int64) after its parent's hash (None: the first block).");
  m.attr("ROOT_BLOCK_HASH") = as_signed(kRootBlockHash);
  m.attr("FINISH_STOP") = static_cast<int32_t>(FinishReason::kStop);
  m.attr("FINISH_LENGTH") = static_cast<int32_t>(FinishReason::kLength);
}
