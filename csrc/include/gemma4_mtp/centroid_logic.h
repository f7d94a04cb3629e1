// The non-GPU logic of the centroid head (centroid_logits.cuh) besides the selection (topk_logic.h),
// tested on the CPU by csrc/tests/test_topk.cpp: the argmax partials, in which an out-of-range
// candidate id (token_ordering is not checked on the GPU) dominates and makes the token's answer
// (-1, NaN); the work plan of the one-launch kernel: how many programs, how candidate rows are cut
// into items and which program owns which item.
#pragma once

#include "gemma4_mtp/host_device.h"
#include "gemma4_mtp/params.h"
#include "gemma4_mtp/topk_logic.h"
#include "gemma4_mtp/tree_logic.h"

namespace gemma4_mtp {

// Argmax partials of candidate logits. kBadIndex marks an out-of-range candidate id: it wins every
// merge, so the token's answer is (-1, NaN) rather than a plausible wrong token. Otherwise
// argmax_merge: highest logit, ties to the lowest id, NaN above all (torch.argmax).
constexpr int kBadIndex = -1;

G4_HD ArgMax candidate_merge(ArgMax a, ArgMax b) {
  if (a.index == kBadIndex) return a;
  if (b.index == kBadIndex) return b;
  return argmax_merge(a, b);
}

// Work plan of the one-launch kernel, in one of two phase-2 orders.
// Token-major: the candidate rows of token t's cluster of rank j are cut into `chunks` items of `rows`
// rows; item i = (t * top_k + j) * chunks + q. Program p owns the contiguous items [items_begin(p),
// items_begin(p + 1)), so that it selects clusters for as few tokens as possible.
// Cluster-major (argmax and topk once the T * top_k (token, cluster) pairs outnumber the SMs): the pairs in
// cluster order, each cluster's member tokens in token order; program p owns the pairs [items_begin(p),
// items_begin(p + 1)) of the T * top_k, and its warps the pairs' items (a pair's rows cut into `chunks` of
// `rows`), so that a cluster's rows are gathered once for all the tokens that selected it, at the same time.
struct CentroidPlan {
  int grid;    // programs (at most one per SM: they meet at a grid-wide barrier)
  int chunks;  // items per (token, cluster)
  int rows;    // candidate rows per item
  int64_t items;  // token-major: items; cluster-major: (token, cluster) pairs
  bool cluster_major;
};

// kAuto: cluster-major where it can run (argmax, topk) once the pairs outnumber the SMs, as the Triton
// plan() decides; a forced order is kept (centroid_logits() refuses kClusters for the other outputs).
inline CentroidOrder centroid_order(CentroidOrder requested, int64_t T, int top_k, int num_sms, bool argmax_or_topk) {
  if (requested != CentroidOrder::kAuto) return requested;
  return argmax_or_topk && T * top_k > num_sms ? CentroidOrder::kClusters : CentroidOrder::kTokens;
}

// Items are cut finer only while there are fewer than one per program (token-major) or per warp
// (cluster-major, warps_per_program), never below 16 rows.
inline CentroidPlan centroid_plan(int64_t T, int top_k, int64_t cluster_size, int C, int num_sms,
                                  int centroids_per_program, CentroidOrder order = CentroidOrder::kTokens,
                                  int warps_per_program = 1) {
  const int64_t pairs = T * top_k;
  const bool clusters = order == CentroidOrder::kClusters;
  const int64_t workers = clusters ? int64_t{num_sms} * warps_per_program : num_sms;
  int64_t chunks = 1;
  while (pairs * chunks * 2 <= workers && cluster_size >= 16 * chunks * 2) chunks *= 2;
  const int64_t rows = ceil_div(cluster_size, chunks);
  chunks = ceil_div(cluster_size, rows);
  // cluster-major: phase 1 wants C / centroids_per_program programs, phase 2 one per selected cluster
  const int64_t want = max64(clusters ? min64(pairs, C) : pairs * chunks, ceil_div(C, centroids_per_program));
  const int grid = static_cast<int>(max64(1, min64(num_sms, want)));
  return CentroidPlan{grid, static_cast<int>(chunks), static_cast<int>(rows), clusters ? pairs : pairs * chunks,
                      clusters};
}

G4_HD int64_t items_begin(int64_t p, int64_t grid, int64_t items) { return p * items / grid; }

// The program whose range holds item i (the largest p with items_begin(p) <= i).
G4_HD int64_t program_of_item(int64_t i, int64_t grid, int64_t items) { return ((i + 1) * grid - 1) / items; }

}  // namespace gemma4_mtp
