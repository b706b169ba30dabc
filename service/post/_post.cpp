// Pipeline stage 4 (post), the hot part: SID -> ads expansion, the exact per-ad
// targeting filter, ranking by beam score and the max_ads cut, for a whole batch.
//
// `service/post/__init__.py` owns the types and checks dtypes; this file only reads the
// index arrays in place (the numpy arrays, possibly read-only memory maps, are held by
// reference, never copied) and runs the requests of a batch in parallel with the GIL
// released. Results are identical to `tests/helpers/reference_post.py` (tests/service/post/
// compares them); the layout is docs/FORMAT.md §1 and §3, the rules are the targeting
// schema's (contracts/targeting_codec.py `exact_eligible`): the bitmask of enum/bucket
// attributes, then K set attributes, each an include and an exclude list per ad, then the
// request's blocks of ad, campaign and advertiser ids.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace {

// c_style | forcecast: an array that already has the dtype and is C-contiguous passes
// through as the same buffer (the Python wrapper refuses anything else for the index).
template <class T>
using Array = py::array_t<T, py::array::c_style | py::array::forcecast>;

constexpr int64_t kSidLength = 4;

// An id list: a raw view into an array the caller keeps alive for the whole call.
template <class T>
struct Ids {
  const T* p = nullptr;
  int64_t n = 0;
};

// One request, as raw views into arrays the caller keeps alive for the whole call.
struct Request {
  const int64_t* leaves;    // [n_leaves] leaf positions
  const float* scores;      // [n_leaves] beam scores
  int64_t n_leaves;
  const uint64_t* bitmask;  // [words]
  std::vector<Ids<int32_t>> sets;  // [K] per set attribute: sorted vocabulary ids
  Ids<int64_t> block_ads, block_campaigns, block_advertisers;  // any order
  int64_t max_ads;
};

struct Result {
  std::vector<int64_t> ad_ids;  // [K] best first
  std::vector<float> scores;    // [K]
  std::vector<int16_t> sids;    // [K * kSidLength]
  int64_t expanded = 0;
  int64_t eligible = 0;
  int64_t blocked = 0, targeting = 0, excluded = 0, not_live = 0;  // expanded - eligible
  int error = 0;  // 0 ok, 1 IndexError, 2 ValueError, 3 other
  std::string message;
};

// Thrown inside a worker, turned into a Python exception once the GIL is back.
struct RequestError {
  int kind;
  std::string message;
};

// numpy's stable argsort of -score: higher score first, NaN after every number, and
// ties (all NaNs included) keep their input order, which stable_sort preserves.
inline bool ranks_before(float a, float b) {
  return a > b || (std::isnan(b) && !std::isnan(a));
}

// Do two sorted lists share an id? A merge that leaps with lower_bound over the longer
// runs: an ad's few ids against a request's up to a few hundred.
inline bool intersects(const int32_t* a, const int32_t* ae, const int32_t* b, const int32_t* be) {
  while (a < ae && b < be) {
    if (*a < *b)
      a = std::lower_bound(a, ae, *b);
    else if (*b < *a)
      b = std::lower_bound(b, be, *a);
    else
      return true;
  }
  return false;
}

// A request's block list (up to a few thousand ids, any order), hashed once per request:
// open addressing with linear probing, at most half full, in front of it a one-hash
// filter of 16 bits per id (4 KB for 2,000 ids: it stays in L1). Nearly every ad is not
// blocked, and the filter turns ~94% of those lookups away with one load and a branch
// that predicts well; the table alone mispredicts on every other probe (a batch with
// blocks of 2,000 ads, 200 campaigns and 20 advertisers per request: 2.3 ms, not 5.4).
class IdSet {
 public:
  IdSet() = default;
  explicit IdSet(Ids<int64_t> ids) {
    if (ids.n == 0) return;
    const int bits = log2_at_least(2 * ids.n), filter_bits = log2_at_least(16 * ids.n);
    shift_ = 64 - bits;
    filter_shift_ = 64 - filter_bits;
    slots_.assign(size_t{1} << bits, kEmpty);
    filter_.assign((size_t{1} << filter_bits) / 64, 0);
    for (int64_t i = 0; i < ids.n; ++i) {
      const int64_t x = ids.p[i];
      const uint64_t f = hash(x) >> filter_shift_;
      filter_[f >> 6] |= uint64_t{1} << (f & 63);
      if (x == kEmpty) {
        has_empty_key_ = true;
        continue;
      }
      size_t s = hash(x) >> shift_;
      while (slots_[s] != kEmpty && slots_[s] != x) s = (s + 1) & (slots_.size() - 1);
      slots_[s] = x;
    }
  }

  bool empty() const { return slots_.empty(); }

  bool contains(int64_t x) const {
    const uint64_t f = hash(x) >> filter_shift_;
    if (!((filter_[f >> 6] >> (f & 63)) & 1)) return false;  // (an empty set's word is 0)
    if (x == kEmpty) return has_empty_key_;
    for (size_t s = hash(x) >> shift_;; s = (s + 1) & (slots_.size() - 1)) {
      if (slots_[s] == x) return true;
      if (slots_[s] == kEmpty) return false;
    }
  }

 private:
  static constexpr int64_t kEmpty = std::numeric_limits<int64_t>::min();
  // Fibonacci hashing: the top bits of the product depend on every bit of the id
  static uint64_t hash(int64_t x) { return static_cast<uint64_t>(x) * 0x9E3779B97F4A7C15ull; }
  static int log2_at_least(int64_t n) {
    int bits = 6;  // one filter word at least
    while ((int64_t{1} << bits) < n) ++bits;
    return bits;
  }
  std::vector<int64_t> slots_;
  std::vector<uint64_t> filter_ = std::vector<uint64_t>(1, 0);
  int shift_ = 58, filter_shift_ = 58;
  bool has_empty_key_ = false;
};

// One set attribute's per-ad id lists (include or exclude) in CSR form; `off` null: no
// ad has such a list, and the test is skipped.
struct IdLists {
  const int64_t* off = nullptr;  // [N + 1]
  const int32_t* ids = nullptr;  // [nnz], sorted per ad
  int64_t nnz = 0;
};

struct SetRules {
  IdLists include, exclude;
};

// Why an expanded ad did not make it, in the order counted (each ad once): a block of the
// request, an include rule, an exclusion.
enum class Verdict { kEligible, kBlocked, kTargeting, kExcluded };

// A set attribute's per-ad lists as handed over: (offsets [N + 1], ids), or None.
using Csr = std::optional<std::pair<Array<int64_t>, Array<int32_t>>>;

class AdIndex {
 public:
  // `include[k]` / `exclude[k]`: set attribute k's per-ad lists, or None without such
  // rules; the optional arrays are the enum/bucket bits each ad's exclusions cleared
  // (only to tell exclusions from include failures in the counts) and each ad's campaign
  // and advertiser (0 = none), which the request's blocks need.
  AdIndex(Array<int16_t> leaf_sids, Array<int64_t> leaf_ad_offsets, Array<int64_t> ad_ids,
          Array<uint64_t> ad_bitmask, std::vector<Csr> include, std::vector<Csr> exclude,
          int threads, std::optional<Array<uint64_t>> ad_exclude_bitmask,
          std::optional<Array<int64_t>> campaign_ids, std::optional<Array<int64_t>> advertiser_ids)
      : leaf_sids_(std::move(leaf_sids)),
        leaf_ad_offsets_(std::move(leaf_ad_offsets)),
        ad_ids_(std::move(ad_ids)),
        ad_bitmask_(std::move(ad_bitmask)),
        threads_(threads) {
    if (threads_ < 1) throw std::invalid_argument("threads must be >= 1");
    if (leaf_sids_.ndim() != 2 || leaf_sids_.shape(1) != kSidLength)
      throw std::invalid_argument("leaf_sids must be [num_leaves, 4]");
    if (ad_bitmask_.ndim() != 2) throw std::invalid_argument("ad_bitmask must be 2-D");
    num_leaves_ = leaf_sids_.shape(0);
    num_ads_ = ad_ids_.shape(0);
    words_ = ad_bitmask_.shape(1);
    if (leaf_ad_offsets_.shape(0) != num_leaves_ + 1)
      throw std::invalid_argument("leaf_ad_offsets must have num_leaves + 1 entries");
    if (ad_bitmask_.shape(0) != num_ads_)
      throw std::invalid_argument("ad_bitmask must have one row per ad");
    if (include.size() != exclude.size())
      throw std::invalid_argument("include and exclude must name the same set attributes");
    // data() is const access: read-only memory maps are fine.
    sids_ = leaf_sids_.data();
    leaf_off_ = leaf_ad_offsets_.data();
    ids_ = ad_ids_.data();
    bits_ = ad_bitmask_.data();
    for (size_t k = 0; k < include.size(); ++k)
      sets_.push_back({hold(include[k], "include", k), hold(exclude[k], "exclude", k)});
    if (ad_exclude_bitmask) {
      if (ad_exclude_bitmask->ndim() != 2 || ad_exclude_bitmask->shape(0) != num_ads_ ||
          ad_exclude_bitmask->shape(1) != words_)
        throw std::invalid_argument("ad_exclude_bitmask must have ad_bitmask's shape");
      ad_exclude_bitmask_ = std::move(ad_exclude_bitmask);
      xbits_ = ad_exclude_bitmask_->data();
    }
    campaign_ = hold_owner(campaign_ids, "campaign_ids");
    advertiser_ = hold_owner(advertiser_ids, "advertiser_ids");
  }

  int threads() const { return threads_; }
  int64_t words() const { return words_; }
  int64_t set_attributes() const { return static_cast<int64_t>(sets_.size()); }

  // Each argument holds one entry per request of the batch, except `set_ids`: K per
  // request, request-major (with K = 1 that is one location list per request).
  py::list run(const std::vector<Array<int64_t>>& leaves, const std::vector<Array<float>>& scores,
               const std::vector<Array<uint64_t>>& bitmasks,
               const std::vector<Array<int32_t>>& set_ids, const std::vector<int64_t>& max_ads,
               const std::optional<std::vector<Array<int64_t>>>& exclude_ad_ids,
               const std::optional<std::vector<Array<int64_t>>>& exclude_campaign_ids,
               const std::optional<std::vector<Array<int64_t>>>& exclude_advertiser_ids,
               const std::optional<Array<uint8_t>>& not_live) {
    const size_t n = leaves.size();
    // the batch's live state (one catalog_seq): non-zero = the ad is not served (paused,
    // deleted, waiting for a rebuild); an immutable snapshot the caller holds for the call
    const uint8_t* dead = nullptr;
    if (not_live) {
      if (not_live->ndim() != 1 || not_live->shape(0) != num_ads_)
        throw std::invalid_argument("not_live must have one entry per ad");
      dead = not_live->data();
    }
    const size_t k_sets = sets_.size();
    auto per_request = [n](const auto& lists) { return !lists || lists->size() == n; };
    if (scores.size() != n || bitmasks.size() != n || max_ads.size() != n ||
        set_ids.size() != n * k_sets || !per_request(exclude_ad_ids) ||
        !per_request(exclude_campaign_ids) || !per_request(exclude_advertiser_ids))
      throw std::invalid_argument("run: per-request argument lists differ in length");
    std::vector<Request> requests(n);
    for (size_t b = 0; b < n; ++b) {
      const std::string where = "request " + std::to_string(b);
      if (leaves[b].ndim() != 1 || scores[b].ndim() != 1 || leaves[b].shape(0) != scores[b].shape(0))
        throw std::invalid_argument(where + ": leaves and scores must be 1-D of one length");
      if (bitmasks[b].ndim() != 1 || bitmasks[b].shape(0) != words_)
        throw std::invalid_argument(where + ": req_bitmask must have " + std::to_string(words_) +
                                    " words");
      if (max_ads[b] < 0) throw std::invalid_argument(where + ": max_ads must be >= 0");
      Request& q = requests[b];
      q = Request{leaves[b].data(), scores[b].data(), leaves[b].shape(0), bitmasks[b].data(),
                  {}, {}, {}, {}, max_ads[b]};
      for (size_t k = 0; k < k_sets; ++k)
        q.sets.push_back(view(set_ids[b * k_sets + k], where + ": set ids"));
      if (exclude_ad_ids) q.block_ads = view((*exclude_ad_ids)[b], where + ": exclude_ad_ids");
      if (exclude_campaign_ids)
        q.block_campaigns = view((*exclude_campaign_ids)[b], where + ": exclude_campaign_ids");
      if (exclude_advertiser_ids)
        q.block_advertisers =
            view((*exclude_advertiser_ids)[b], where + ": exclude_advertiser_ids");
    }
    std::vector<Result> results(n);
    {
      // Only raw pointers are touched from here on; the arrays stay referenced by the
      // caller's lists and by this object for the whole call.
      py::gil_scoped_release release;
      run_parallel(requests, results, dead);
    }
    py::list out;
    for (size_t b = 0; b < n; ++b) {
      Result& r = results[b];
      if (r.error == 1) throw py::index_error("request " + std::to_string(b) + ": " + r.message);
      if (r.error == 2) throw py::value_error("request " + std::to_string(b) + ": " + r.message);
      if (r.error) throw std::runtime_error("request " + std::to_string(b) + ": " + r.message);
      const py::ssize_t k = static_cast<py::ssize_t>(r.ad_ids.size());
      Array<int64_t> ids(k);
      Array<float> sc(k);
      Array<int16_t> sids({k, static_cast<py::ssize_t>(kSidLength)});
      if (k) {
        std::memcpy(ids.mutable_data(), r.ad_ids.data(), k * sizeof(int64_t));
        std::memcpy(sc.mutable_data(), r.scores.data(), k * sizeof(float));
        std::memcpy(sids.mutable_data(), r.sids.data(), k * kSidLength * sizeof(int16_t));
      }
      out.append(py::make_tuple(ids, sc, sids, r.expanded, r.eligible, r.blocked, r.targeting,
                                r.excluded, r.not_live));
    }
    return out;
  }

 private:
  template <class T>
  static Ids<T> view(const Array<T>& a, const std::string& what) {
    if (a.ndim() != 1) throw std::invalid_argument(what + " must be 1-D");
    return {a.data(), a.shape(0)};
  }

  IdLists hold(Csr& csr, const char* what, size_t k) {
    if (!csr) return {};
    auto& [off, ids] = *csr;
    const std::string name = std::string(what) + "[" + std::to_string(k) + "]";
    if (off.ndim() != 1 || off.shape(0) != num_ads_ + 1)
      throw std::invalid_argument(name + ": offsets must have num_ads + 1 entries");
    if (ids.ndim() != 1) throw std::invalid_argument(name + ": ids must be 1-D");
    held_int64_.push_back(std::move(off));
    held_int32_.push_back(std::move(ids));
    return {held_int64_.back().data(), held_int32_.back().data(), held_int32_.back().shape(0)};
  }

  const int64_t* hold_owner(std::optional<Array<int64_t>>& owner, const char* what) {
    if (!owner) return nullptr;
    if (owner->ndim() != 1 || owner->shape(0) != num_ads_)
      throw std::invalid_argument(std::string(what) + " must have one entry per ad");
    held_int64_.push_back(std::move(*owner));
    return held_int64_.back().data();
  }

  // Requests are claimed from a shared counter by min(threads, batch) workers; the
  // calling thread is one of them, so a batch of one spawns nothing.
  void run_parallel(const std::vector<Request>& requests, std::vector<Result>& results,
                    const uint8_t* dead) const {
    const size_t n = requests.size();
    std::atomic<size_t> next{0};
    auto work = [&]() {
      for (size_t b; (b = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        try {
          process(requests[b], results[b], dead);
        } catch (const RequestError& e) {
          results[b].error = e.kind;
          results[b].message = e.message;
        } catch (const std::exception& e) {
          results[b].error = 3;
          results[b].message = e.what();
        }
      }
    };
    const size_t workers = std::min<size_t>(static_cast<size_t>(threads_), n);
    std::vector<std::thread> pool;
    pool.reserve(workers > 0 ? workers - 1 : 0);
    for (size_t i = 1; i < workers; ++i) {
      try {
        pool.emplace_back(work);
      } catch (const std::system_error&) {
        break;  // no more threads available: the ones we have finish the batch
      }
    }
    work();
    for (auto& t : pool) t.join();
  }

  // One set rule as a request applies it: the ads' lists and the request's sorted ids.
  struct Probe {
    IdLists lists;
    const int32_t *req = nullptr, *req_end = nullptr;
  };

  // What a request tests per ad, derived once per request.
  struct Plan {
    // Only the request's non-zero words can fail `(ad & req) == req`: a request sets one
    // bit per attribute, so this is 2-3 words of 5, tested in bit order (country first).
    std::vector<std::pair<int64_t, uint64_t>> need;  // (word, request bits)
    std::vector<Probe> include;  // the set attributes with include lists
    std::vector<Probe> exclude;  // ... with exclude lists, where the request has ids
    IdSet block_ads, block_campaigns, block_advertisers;  // hashed once
    bool blocks = false;                                  // any of them
  };

  // The hot part of a plan as raw pointers, handed by value to the inlined per-ad test so
  // that it stays in registers: members of `this` and of the plan's vectors are otherwise
  // loaded again after every kept ad (its copy into the result may alias them).
  struct Scan {
    const uint64_t* bits;
    int64_t words;
    const std::pair<int64_t, uint64_t>*need, *need_end;
    const Probe *include, *include_end, *exclude, *exclude_end;
    Probe first;  // include[0] (Mode::kOneInclude)
    const Plan* plan;
  };

  // The per-ad test, specialised per request: kFull tests and tells apart every rule;
  // without blocks and exclusions to test (the common case) every failure is an include
  // failure, and an index of the default schema has exactly one include rule, locations,
  // held in registers (a few % of the default path's time, against a loop of one probe).
  enum class Mode { kFull, kIncludes, kOneInclude };

  void process(const Request& q, Result& r, const uint8_t* dead) const {
    for (int64_t i = 0; i < q.n_leaves; ++i) {
      const int64_t leaf = q.leaves[i];
      if (leaf < 0 || leaf >= num_leaves_)
        throw RequestError{1, "leaf " + std::to_string(leaf) + " out of range [0, " +
                                  std::to_string(num_leaves_) + ")"};
    }
    Plan plan;
    for (int64_t w = 0; w < words_; ++w)
      if (q.bitmask[w]) plan.need.emplace_back(w, q.bitmask[w]);
    for (size_t k = 0; k < sets_.size(); ++k) {
      const Ids<int32_t> ids = q.sets[k];
      if (!std::is_sorted(ids.p, ids.p + ids.n))
        throw RequestError{2, "the ids of set attribute " + std::to_string(k) +
                                  " must be sorted ascending"};
      if (sets_[k].include.off) plan.include.push_back({sets_[k].include, ids.p, ids.p + ids.n});
      // a request without ids of the attribute meets no exclude list
      if (sets_[k].exclude.off && ids.n)
        plan.exclude.push_back({sets_[k].exclude, ids.p, ids.p + ids.n});
    }
    plan.block_ads = IdSet(q.block_ads);
    // an index without campaign (advertiser) ids has none to block
    if (campaign_) plan.block_campaigns = IdSet(q.block_campaigns);
    if (advertiser_) plan.block_advertisers = IdSet(q.block_advertisers);
    plan.blocks = !plan.block_ads.empty() || !plan.block_campaigns.empty() ||
                  !plan.block_advertisers.empty();

    // All ads of a leaf share its score, so ranking the leaves (stably, ties in input
    // order) and walking each leaf's ads in row order is numpy's stable argsort over the
    // expanded rows — at the cost of sorting S leaves instead of ~10 S ads.
    std::vector<int64_t> order(q.n_leaves);
    std::iota(order.begin(), order.end(), int64_t{0});
    auto by_score = [&](int64_t a, int64_t b) { return ranks_before(q.scores[a], q.scores[b]); };
    // beam search emits its leaves best first: one O(S) pass spares the sort
    if (!std::is_sorted(order.begin(), order.end(), by_score))
      std::stable_sort(order.begin(), order.end(), by_score);

    const Scan scan{bits_,
                    words_,
                    plan.need.data(),
                    plan.need.data() + plan.need.size(),
                    plan.include.data(),
                    plan.include.data() + plan.include.size(),
                    plan.exclude.data(),
                    plan.exclude.data() + plan.exclude.size(),
                    plan.include.empty() ? Probe{} : plan.include[0],
                    &plan};
    if (plan.blocks || !plan.exclude.empty() || xbits_)
      walk<Mode::kFull>(q, order, scan, dead, r);
    else if (plan.include.size() == 1)
      walk<Mode::kOneInclude>(q, order, scan, dead, r);
    else
      walk<Mode::kIncludes>(q, order, scan, dead, r);
  }

  // The ads of the ranked leaves, in order: judged, counted, and the first max_ads
  // eligible ones kept. An ad not live (`dead`) is counted as such before any rule. One function per mode: inlined into one, the modes' loops slow
  // each other down (~10%: registers and code layout).
  template <Mode M>
  __attribute__((noinline)) void walk(const Request& q, const std::vector<int64_t>& order,
                                      const Scan scan, const uint8_t* dead, Result& r) const {
    const size_t cap = static_cast<size_t>(q.max_ads);
    const size_t n = order.size();
    // counters in registers, not in r: its vectors grow in the loop, and a store through
    // their int64_t pointers could alias r's counters
    int64_t expanded = 0, eligible = 0, blocked = 0, targeting = 0, excluded = 0, gone = 0;
    for (size_t i = 0; i < n; ++i) {
      prefetch_offsets(q.leaves, order, i + kFar);
      prefetch_ads<M>(q.leaves, order, i + kNear, scan);
      const int64_t pos = order[i];
      const int64_t leaf = q.leaves[pos];
      const int64_t lo = leaf_off_[leaf], hi = leaf_off_[leaf + 1];
      if (lo < 0 || hi < lo || hi > num_ads_)
        throw RequestError{2, "corrupt index: leaf_ad_offsets of leaf " + std::to_string(leaf)};
      expanded += hi - lo;
      for (int64_t row = lo; row < hi; ++row) {
        if (dead && dead[row]) {
          ++gone;
          continue;
        }
        switch (judge<M>(row, scan)) {
          case Verdict::kEligible: break;
          case Verdict::kTargeting:
            if (M == Mode::kFull) ++targeting;  // else every failure: counted once, below
            continue;
          case Verdict::kBlocked: ++blocked; continue;
          case Verdict::kExcluded: ++excluded; continue;
        }
        ++eligible;
        if (r.ad_ids.size() < cap) {  // past the cut we still count, for Stats.ads_eligible
          r.ad_ids.push_back(ids_[row]);
          r.scores.push_back(q.scores[pos]);
          r.sids.insert(r.sids.end(), sids_ + leaf * kSidLength, sids_ + (leaf + 1) * kSidLength);
        }
      }
    }
    r.expanded = expanded;
    r.eligible = eligible;
    r.blocked = blocked;
    r.targeting = M == Mode::kFull ? targeting : expanded - gone - eligible;
    r.excluded = excluded;
    r.not_live = gone;
  }

  // Leaves come in random index order and a large index is far bigger than the caches,
  // so each leaf costs a chain of misses (offsets -> ad rows). Prefetching the offsets of
  // the leaf kFar ahead and the ad rows of the leaf kNear ahead keeps ~kFar misses in
  // flight instead of one. Prefetches never fault, so no bounds checks are needed here.
  static constexpr size_t kFar = 16, kNear = 6, kMaxLines = 8;

  void prefetch_offsets(const int64_t* leaves, const std::vector<int64_t>& order,
                        size_t i) const {
    if (i < order.size()) __builtin_prefetch(leaf_off_ + leaves[order[i]]);
  }

  template <Mode M>
  void prefetch_ads(const int64_t* leaves, const std::vector<int64_t>& order, size_t i,
                    const Scan& scan) const {
    if (i >= order.size()) return;
    const int64_t leaf = leaves[order[i]];
    const int64_t lo = leaf_off_[leaf], hi = leaf_off_[leaf + 1];
    __builtin_prefetch(sids_ + leaf * kSidLength);
    __builtin_prefetch(ids_ + lo);
    prefetch_rows(bits_, lo, hi);
    if (M == Mode::kOneInclude) {
      __builtin_prefetch(scan.first.lists.off + lo);
      return;
    }
    for (const Probe* p = scan.include; p != scan.include_end; ++p)
      __builtin_prefetch(p->lists.off + lo);
    if (M != Mode::kFull) return;
    for (const Probe* p = scan.exclude; p != scan.exclude_end; ++p)
      __builtin_prefetch(p->lists.off + lo);
    if (scan.plan->blocks) {
      if (campaign_) __builtin_prefetch(campaign_ + lo);
      if (advertiser_) __builtin_prefetch(advertiser_ + lo);
    }
    if (xbits_) prefetch_rows(xbits_, lo, hi);
  }

  void prefetch_rows(const uint64_t* rows, int64_t lo, int64_t hi) const {
    const char* first = reinterpret_cast<const char*>(rows + lo * words_);
    const char* last = reinterpret_cast<const char*>(rows + hi * words_);
    for (size_t k = 0; k < kMaxLines && first + 64 * k < last; ++k)
      __builtin_prefetch(first + 64 * k);
  }

  // docs/ARCHITECTURE.md §3 for one ad, exact (set rules by actual ids, never Bloom
  // bits), and why it fails, counted in this order: a block of the request; else an
  // include rule (the bitmask's include part: `((ad | excluded bits) & req) != req`, or a
  // set attribute's include list sharing no id with the request); else an exclusion (the
  // bitmask failing only on excluded enum/bucket bits, or a set exclude list sharing one).
  template <Mode M>
  Verdict judge(int64_t row, const Scan& s) const {
    if (M == Mode::kFull && s.plan->blocks) {
      const Plan& p = *s.plan;
      if (p.block_ads.contains(ids_[row]) ||
          (campaign_ && p.block_campaigns.contains(campaign_[row])) ||
          (advertiser_ && p.block_advertisers.contains(advertiser_[row])))
        return Verdict::kBlocked;
    }
    const uint64_t* m = s.bits + row * s.words;
    bool excluded = false;
    for (auto it = s.need; it != s.need_end; ++it) {  // early exit on the first failing word
      const auto [w, req] = *it;
      if ((m[w] & req) == req) continue;
      // without excluded bits (or not failing on them) it is an include failure
      if (M != Mode::kFull || !xbits_ || ((m[w] | xbits_[row * s.words + w]) & req) != req)
        return Verdict::kTargeting;
      excluded = true;  // an include failure further on still counts first
    }
    if (M == Mode::kOneInclude) {
      if (!shares(s.first, row, true)) return Verdict::kTargeting;
      return Verdict::kEligible;
    }
    for (const Probe* p = s.include; p != s.include_end; ++p)
      if (!shares(*p, row, true)) return Verdict::kTargeting;
    if (M != Mode::kFull) return Verdict::kEligible;
    if (excluded) return Verdict::kExcluded;
    for (const Probe* p = s.exclude; p != s.exclude_end; ++p)
      if (shares(*p, row, false)) return Verdict::kExcluded;
    return Verdict::kEligible;
  }

  // Does the ad's list share an id with the request's? `empty`: the answer for an ad
  // without a list (an include rule holds, an exclude rule does not hit).
  static bool shares(const Probe& p, int64_t row, bool empty) {
    const int64_t lo = p.lists.off[row], hi = p.lists.off[row + 1];
    if (lo == hi) return empty;
    if (lo < 0 || hi < lo || hi > p.lists.nnz)
      throw RequestError{2, "corrupt index: set rule offsets of row " + std::to_string(row)};
    return intersects(p.lists.ids + lo, p.lists.ids + hi, p.req, p.req_end);
  }

  // Held so the buffers outlive every call; the raw pointers below point into them.
  Array<int16_t> leaf_sids_;
  Array<int64_t> leaf_ad_offsets_;
  Array<int64_t> ad_ids_;
  Array<uint64_t> ad_bitmask_;
  std::vector<Array<int64_t>> held_int64_;  // set lists' offsets, campaign and advertiser ids
  std::vector<Array<int32_t>> held_int32_;  // set lists' ids
  std::optional<Array<uint64_t>> ad_exclude_bitmask_;
  int threads_;
  int64_t num_leaves_ = 0, num_ads_ = 0, words_ = 0;
  const int16_t* sids_ = nullptr;
  const int64_t* leaf_off_ = nullptr;
  const int64_t* ids_ = nullptr;
  const uint64_t* bits_ = nullptr;
  std::vector<SetRules> sets_;          // [K] set attributes, the schema's order
  const uint64_t* xbits_ = nullptr;     // [N, words] excluded enum/bucket bits, or null
  const int64_t* campaign_ = nullptr;   // [N] or null
  const int64_t* advertiser_ = nullptr; // [N] or null
};

// ----------------------------------------------------------------------------------------
// The reply's `repeated Ad ads = 1` in protobuf wire format (grace.v1.RetrieveResponse):
// building 1,000 Python `Ad` messages per request costs ~1 ms of the event loop, so the
// server parses these bytes instead (one C-speed parse). Ad: ad_id = 1 (int64, varint),
// score = 2 (float, fixed32), sid = 3 (repeated int32, packed; omitted without sids).

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

py::bytes encode_ads(Array<int64_t> ad_ids, Array<float> scores,
                     std::optional<Array<int16_t>> sids) {
  const int64_t k = ad_ids.size();
  if (ad_ids.ndim() != 1 || scores.ndim() != 1 || scores.size() != k)
    throw std::invalid_argument("ad_ids and scores must be 1-D arrays of one length");
  if (sids && (sids->ndim() != 2 || sids->shape(0) != k || sids->shape(1) != kSidLength))
    throw std::invalid_argument("sids must be [len(ad_ids), 4]");
  const int64_t* id = ad_ids.data();
  const float* sc = scores.data();
  const int16_t* sid = sids ? sids->data() : nullptr;
  std::string out, body, packed;
  out.reserve(static_cast<size_t>(k) * (sid ? 24 : 16));
  for (int64_t i = 0; i < k; ++i) {
    body.clear();
    body.push_back(0x08);  // field 1, varint
    put_varint(body, static_cast<uint64_t>(id[i]));
    body.push_back(0x15);  // field 2, fixed32
    uint32_t bits;
    std::memcpy(&bits, sc + i, sizeof bits);
    for (int b = 0; b < 4; ++b) body.push_back(static_cast<char>((bits >> (8 * b)) & 0xFF));
    if (sid) {
      packed.clear();
      for (int64_t j = 0; j < kSidLength; ++j)  // int32 varints sign-extend to 64 bits
        put_varint(packed, static_cast<uint64_t>(static_cast<int64_t>(sid[i * kSidLength + j])));
      body.push_back(0x1A);  // field 3, length-delimited (packed)
      put_varint(body, packed.size());
      body += packed;
    }
    out.push_back(0x0A);  // RetrieveResponse field 1, length-delimited
    put_varint(out, body.size());
    out += body;
  }
  return py::bytes(out);
}

}  // namespace

PYBIND11_MODULE(_post, m) {
  m.doc() = "C++ post stage (pipeline stage 4): expansion, exact filter, rank, cut.";
  py::class_<AdIndex>(m, "AdIndex")
      // the form before declared schemas: one set attribute (locations), include lists only
      .def(py::init([](Array<int16_t> leaf_sids, Array<int64_t> leaf_ad_offsets,
                       Array<int64_t> ad_ids, Array<uint64_t> ad_bitmask,
                       Array<int64_t> ad_loc_offsets, Array<int32_t> ad_loc_ids, int threads) {
             std::vector<Csr> include(1), exclude(1);
             include[0].emplace(std::move(ad_loc_offsets), std::move(ad_loc_ids));
             return new AdIndex(std::move(leaf_sids), std::move(leaf_ad_offsets),
                                std::move(ad_ids), std::move(ad_bitmask), std::move(include),
                                std::move(exclude), threads, std::nullopt, std::nullopt,
                                std::nullopt);
           }),
           py::arg("leaf_sids"), py::arg("leaf_ad_offsets"), py::arg("ad_ids"),
           py::arg("ad_bitmask"), py::arg("ad_loc_offsets"), py::arg("ad_loc_ids"),
           py::arg("threads"))
      .def(py::init<Array<int16_t>, Array<int64_t>, Array<int64_t>, Array<uint64_t>,
                    std::vector<Csr>, std::vector<Csr>, int,
                    std::optional<Array<uint64_t>>, std::optional<Array<int64_t>>,
                    std::optional<Array<int64_t>>>(),
           py::arg("leaf_sids"), py::arg("leaf_ad_offsets"), py::arg("ad_ids"),
           py::arg("ad_bitmask"), py::kw_only(), py::arg("include"), py::arg("exclude"),
           py::arg("threads"), py::arg("ad_exclude_bitmask") = py::none(),
           py::arg("campaign_ids") = py::none(), py::arg("advertiser_ids") = py::none())
      .def_property_readonly("threads", &AdIndex::threads)
      .def_property_readonly("words", &AdIndex::words)
      .def_property_readonly("set_attributes", &AdIndex::set_attributes)
      .def("run", &AdIndex::run, py::arg("leaves"), py::arg("scores"), py::arg("bitmasks"),
           py::arg("set_ids"), py::arg("max_ads"), py::kw_only(),
           py::arg("exclude_ad_ids") = py::none(), py::arg("exclude_campaign_ids") = py::none(),
           py::arg("exclude_advertiser_ids") = py::none(), py::arg("not_live") = py::none());
  m.def("encode_ads", &encode_ads, py::arg("ad_ids"), py::arg("scores"),
        py::arg("sids") = py::none(),
        "The reply's `repeated Ad ads = 1` field in protobuf wire format.");
}
