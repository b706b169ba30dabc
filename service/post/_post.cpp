// Pipeline stage 4 (post), the hot part: SID -> ads expansion, the exact per-ad
// targeting filter, ranking by beam score and the max_ads cut, for a whole batch.
//
// `service/post/__init__.py` owns the types and checks dtypes; this file only reads the
// index arrays in place (the numpy arrays, possibly read-only memory maps, are held by
// reference, never copied) and runs the requests of a batch in parallel with the GIL
// released. Results are identical to `tests/helpers/reference_post.py::expand_and_filter`
// (tests/service/post/ compares them); the layout is docs/FORMAT.md §1 and §3.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
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

// One request, as raw views into arrays the caller keeps alive for the whole call.
struct Request {
  const int64_t* leaves;    // [n_leaves] leaf positions
  const float* scores;      // [n_leaves] beam scores
  int64_t n_leaves;
  const uint64_t* bitmask;  // [words]
  const int32_t* loc_ids;   // [n_loc] sorted location ids
  int64_t n_loc;
  int64_t max_ads;
};

struct Result {
  std::vector<int64_t> ad_ids;  // [K] best first
  std::vector<float> scores;    // [K]
  std::vector<int16_t> sids;    // [K * kSidLength]
  int64_t expanded = 0;
  int64_t eligible = 0;
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

class AdIndex {
 public:
  AdIndex(Array<int16_t> leaf_sids, Array<int64_t> leaf_ad_offsets, Array<int64_t> ad_ids,
          Array<uint64_t> ad_bitmask, Array<int64_t> ad_loc_offsets, Array<int32_t> ad_loc_ids,
          int threads)
      : leaf_sids_(std::move(leaf_sids)),
        leaf_ad_offsets_(std::move(leaf_ad_offsets)),
        ad_ids_(std::move(ad_ids)),
        ad_bitmask_(std::move(ad_bitmask)),
        ad_loc_offsets_(std::move(ad_loc_offsets)),
        ad_loc_ids_(std::move(ad_loc_ids)),
        threads_(threads) {
    if (threads_ < 1) throw std::invalid_argument("threads must be >= 1");
    if (leaf_sids_.ndim() != 2 || leaf_sids_.shape(1) != kSidLength)
      throw std::invalid_argument("leaf_sids must be [num_leaves, 4]");
    if (ad_bitmask_.ndim() != 2) throw std::invalid_argument("ad_bitmask must be 2-D");
    num_leaves_ = leaf_sids_.shape(0);
    num_ads_ = ad_ids_.shape(0);
    words_ = ad_bitmask_.shape(1);
    nnz_ = ad_loc_ids_.shape(0);
    if (leaf_ad_offsets_.shape(0) != num_leaves_ + 1)
      throw std::invalid_argument("leaf_ad_offsets must have num_leaves + 1 entries");
    if (ad_bitmask_.shape(0) != num_ads_)
      throw std::invalid_argument("ad_bitmask must have one row per ad");
    if (ad_loc_offsets_.shape(0) != num_ads_ + 1)
      throw std::invalid_argument("ad_loc_offsets must have num_ads + 1 entries");
    // data() is const access: read-only memory maps are fine.
    sids_ = leaf_sids_.data();
    leaf_off_ = leaf_ad_offsets_.data();
    ids_ = ad_ids_.data();
    bits_ = ad_bitmask_.data();
    loc_off_ = ad_loc_offsets_.data();
    locs_ = ad_loc_ids_.data();
  }

  int threads() const { return threads_; }
  int64_t words() const { return words_; }

  // Each argument holds one entry per request of the batch.
  py::list run(const std::vector<Array<int64_t>>& leaves, const std::vector<Array<float>>& scores,
               const std::vector<Array<uint64_t>>& bitmasks,
               const std::vector<Array<int32_t>>& loc_ids, const std::vector<int64_t>& max_ads) {
    const size_t n = leaves.size();
    if (scores.size() != n || bitmasks.size() != n || loc_ids.size() != n || max_ads.size() != n)
      throw std::invalid_argument("run: per-request argument lists differ in length");
    std::vector<Request> requests(n);
    for (size_t b = 0; b < n; ++b) {
      if (leaves[b].ndim() != 1 || scores[b].ndim() != 1 || leaves[b].shape(0) != scores[b].shape(0))
        throw std::invalid_argument("request " + std::to_string(b) +
                                    ": leaves and scores must be 1-D of one length");
      if (bitmasks[b].ndim() != 1 || bitmasks[b].shape(0) != words_)
        throw std::invalid_argument("request " + std::to_string(b) + ": req_bitmask must have " +
                                    std::to_string(words_) + " words");
      if (loc_ids[b].ndim() != 1)
        throw std::invalid_argument("request " + std::to_string(b) + ": req_loc_ids must be 1-D");
      if (max_ads[b] < 0)
        throw std::invalid_argument("request " + std::to_string(b) + ": max_ads must be >= 0");
      requests[b] = Request{leaves[b].data(), scores[b].data(),  leaves[b].shape(0),
                            bitmasks[b].data(), loc_ids[b].data(), loc_ids[b].shape(0),
                            max_ads[b]};
    }
    std::vector<Result> results(n);
    {
      // Only raw pointers are touched from here on; the arrays stay referenced by the
      // caller's lists and by this object for the whole call.
      py::gil_scoped_release release;
      run_parallel(requests, results);
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
      out.append(py::make_tuple(ids, sc, sids, r.expanded, r.eligible));
    }
    return out;
  }

 private:
  // Requests are claimed from a shared counter by min(threads, batch) workers; the
  // calling thread is one of them, so a batch of one spawns nothing.
  void run_parallel(const std::vector<Request>& requests, std::vector<Result>& results) const {
    const size_t n = requests.size();
    std::atomic<size_t> next{0};
    auto work = [&]() {
      for (size_t b; (b = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        try {
          process(requests[b], results[b]);
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

  void process(const Request& q, Result& r) const {
    for (int64_t i = 0; i < q.n_leaves; ++i) {
      const int64_t leaf = q.leaves[i];
      if (leaf < 0 || leaf >= num_leaves_)
        throw RequestError{1, "leaf " + std::to_string(leaf) + " out of range [0, " +
                                  std::to_string(num_leaves_) + ")"};
    }
    for (int64_t j = 1; j < q.n_loc; ++j)
      if (q.loc_ids[j] < q.loc_ids[j - 1])
        throw RequestError{2, "req_loc_ids must be sorted ascending"};

    // Only the request's non-zero words can fail `(ad & req) == req`: a request sets one
    // bit per attribute, so this is 2-3 words of 5, tested in bit order (country first).
    std::vector<std::pair<int64_t, uint64_t>> need;
    for (int64_t w = 0; w < words_; ++w)
      if (q.bitmask[w]) need.emplace_back(w, q.bitmask[w]);

    // All ads of a leaf share its score, so ranking the leaves (stably, ties in input
    // order) and walking each leaf's ads in row order is numpy's stable argsort over the
    // expanded rows — at the cost of sorting S leaves instead of ~10 S ads.
    std::vector<int64_t> order(q.n_leaves);
    std::iota(order.begin(), order.end(), int64_t{0});
    auto by_score = [&](int64_t a, int64_t b) { return ranks_before(q.scores[a], q.scores[b]); };
    // beam search emits its leaves best first: one O(S) pass spares the sort
    if (!std::is_sorted(order.begin(), order.end(), by_score))
      std::stable_sort(order.begin(), order.end(), by_score);

    const size_t cap = static_cast<size_t>(q.max_ads);
    const size_t n = order.size();
    for (size_t i = 0; i < n; ++i) {
      prefetch_offsets(q.leaves, order, i + kFar);
      prefetch_ads(q.leaves, order, i + kNear);
      const int64_t pos = order[i];
      const int64_t leaf = q.leaves[pos];
      const int64_t lo = leaf_off_[leaf], hi = leaf_off_[leaf + 1];
      if (lo < 0 || hi < lo || hi > num_ads_)
        throw RequestError{2, "corrupt index: leaf_ad_offsets of leaf " + std::to_string(leaf)};
      r.expanded += hi - lo;
      for (int64_t row = lo; row < hi; ++row) {
        if (!eligible(row, need, q)) continue;
        ++r.eligible;
        if (r.ad_ids.size() < cap) {  // past the cut we still count, for Stats.ads_eligible
          r.ad_ids.push_back(ids_[row]);
          r.scores.push_back(q.scores[pos]);
          r.sids.insert(r.sids.end(), sids_ + leaf * kSidLength, sids_ + (leaf + 1) * kSidLength);
        }
      }
    }
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

  void prefetch_ads(const int64_t* leaves, const std::vector<int64_t>& order, size_t i) const {
    if (i >= order.size()) return;
    const int64_t leaf = leaves[order[i]];
    const int64_t lo = leaf_off_[leaf], hi = leaf_off_[leaf + 1];
    __builtin_prefetch(sids_ + leaf * kSidLength);
    __builtin_prefetch(ids_ + lo);
    __builtin_prefetch(loc_off_ + lo);
    const char* first = reinterpret_cast<const char*>(bits_ + lo * words_);
    const char* last = reinterpret_cast<const char*>(bits_ + hi * words_);
    for (size_t k = 0; k < kMaxLines && first + 64 * k < last; ++k)
      __builtin_prefetch(first + 64 * k);
  }

  // DESIGN.md §3 for one ad: bitmask rules exact, locations by actual ids (never Bloom).
  bool eligible(int64_t row, const std::vector<std::pair<int64_t, uint64_t>>& need,
                const Request& q) const {
    const uint64_t* m = bits_ + row * words_;
    for (const auto& [w, req] : need)
      if ((m[w] & req) != req) return false;  // early exit on the first failing word
    const int64_t lo = loc_off_[row], hi = loc_off_[row + 1];
    if (lo == hi) return true;  // no location rule
    if (lo < 0 || hi < lo || hi > nnz_)
      throw RequestError{2, "corrupt index: ad_loc_offsets of row " + std::to_string(row)};
    // Both lists sorted: a merge that leaps with lower_bound over the longer runs.
    const int32_t *a = locs_ + lo, *ae = locs_ + hi;
    const int32_t *b = q.loc_ids, *be = q.loc_ids + q.n_loc;
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

  // Held so the buffers outlive every call; the raw pointers below point into them.
  Array<int16_t> leaf_sids_;
  Array<int64_t> leaf_ad_offsets_;
  Array<int64_t> ad_ids_;
  Array<uint64_t> ad_bitmask_;
  Array<int64_t> ad_loc_offsets_;
  Array<int32_t> ad_loc_ids_;
  int threads_;
  int64_t num_leaves_ = 0, num_ads_ = 0, words_ = 0, nnz_ = 0;
  const int16_t* sids_ = nullptr;
  const int64_t* leaf_off_ = nullptr;
  const int64_t* ids_ = nullptr;
  const uint64_t* bits_ = nullptr;
  const int64_t* loc_off_ = nullptr;
  const int32_t* locs_ = nullptr;
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
      .def(py::init<Array<int16_t>, Array<int64_t>, Array<int64_t>, Array<uint64_t>,
                    Array<int64_t>, Array<int32_t>, int>(),
           py::arg("leaf_sids"), py::arg("leaf_ad_offsets"), py::arg("ad_ids"),
           py::arg("ad_bitmask"), py::arg("ad_loc_offsets"), py::arg("ad_loc_ids"),
           py::arg("threads"))
      .def_property_readonly("threads", &AdIndex::threads)
      .def_property_readonly("words", &AdIndex::words)
      .def("run", &AdIndex::run, py::arg("leaves"), py::arg("scores"), py::arg("bitmasks"),
           py::arg("loc_ids"), py::arg("max_ads"));
  m.def("encode_ads", &encode_ads, py::arg("ad_ids"), py::arg("scores"),
        py::arg("sids") = py::none(),
        "The reply's `repeated Ad ads = 1` field in protobuf wire format.");
}
