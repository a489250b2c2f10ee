#include "framework/observe/trace.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "base/error.hpp"

#if MESHTRAIN_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

namespace meshtrain {

const char* to_string(TraceKind kind) {
  switch (kind) {
    case TraceKind::step:
      return "step";
    case TraceKind::phase:
      return "phase";
    case TraceKind::layer:
      return "layer";
    case TraceKind::gemm:
      return "gemm";
    case TraceKind::collective:
      return "collective";
    case TraceKind::wait:
      return "wait";
  }
  return "phase";
}

int64_t Tracer::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Tracer::start(std::size_t capacity) {
  events_.clear();
  events_.reserve(capacity);
  device_timer::reserve(std::min(2 * capacity, kDeviceMarkers));
  dropped_ = 0;
  {
    std::lock_guard<std::mutex> lock(lanes_mutex_);
    for (const auto& lane : lanes_) {
      std::lock_guard<std::mutex> lane_lock(lane->mutex);
      lane->events.clear();
      lane->dropped = 0;
    }
  }
  owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
  on_.store(true, std::memory_order_release);
}

TraceLane*& Tracer::this_thread_lane_slot() {
  static thread_local TraceLane* lane = nullptr;
  return lane;
}

TraceLane* Tracer::attach_lane(const char* name) {
  std::lock_guard<std::mutex> lock(lanes_mutex_);
  for (const auto& lane : lanes_) {
    if (!lane->attached && lane->name == name) {
      lane->attached = true;
      return lane.get();
    }
  }
  auto lane = std::make_unique<TraceLane>();
  lane->name = name;
  lane->events.reserve(TraceLane::kCapacity);
  lane->attached = true;
  lanes_.push_back(std::move(lane));
  return lanes_.back().get();
}

void Tracer::detach_lane(TraceLane* lane) {
  std::lock_guard<std::mutex> lock(lanes_mutex_);
  lane->attached = false;
}

std::vector<TraceLaneEvents> Tracer::lane_events() {
  std::vector<TraceLaneEvents> out;
  std::lock_guard<std::mutex> lock(lanes_mutex_);
  for (const auto& lane : lanes_) {
    std::lock_guard<std::mutex> lane_lock(lane->mutex);
    if (lane->events.empty() && lane->dropped == 0) continue;
    out.push_back({lane->name, lane->events, lane->dropped});
  }
  return out;
}

TraceLaneScope::TraceLaneScope(const char* name)
    : lane_(tracer().attach_lane(name)), outer_(Tracer::this_thread_lane_slot()) {
  Tracer::this_thread_lane_slot() = lane_;
}

TraceLaneScope::~TraceLaneScope() {
  Tracer::this_thread_lane_slot() = outer_;
  tracer().detach_lane(lane_);
}

void nvtx_push(const char* name) {
#if MESHTRAIN_NVTX
  nvtxRangePushA(name);
#else
  (void)name;
#endif
}

void nvtx_pop() {
#if MESHTRAIN_NVTX
  nvtxRangePop();
#endif
}

Tracer& tracer() {
  static Tracer instance;
  return instance;
}

namespace {

// A track's order: by start, the enclosing span first.
bool starts_first(const TraceEvent* a, const TraceEvent* b) {
  if (a->begin_ns != b->begin_ns) return a->begin_ns < b->begin_ns;
  return a->end_ns > b->end_ns;
}

// Microseconds (Chrome's unit) with nanoseconds kept as the fraction.
double micros(int64_t ns) {
  return static_cast<double>(ns) / 1000.0;
}

}  // namespace

void write_chrome_trace(const std::vector<TraceEvent>& events,
                        const std::vector<int64_t>& device_ns,
                        const std::vector<TraceLaneEvents>& lanes, std::size_t dropped, int rank,
                        int ranks, int64_t clock_offset_ns, int64_t origin_ns,
                        const std::string& path) {
  // Sorted by start, the enclosing span first: each track reads in time order.
  std::vector<const TraceEvent*> order;
  order.reserve(events.size());
  for (const TraceEvent& e : events) order.push_back(&e);
  std::stable_sort(order.begin(), order.end(), starts_first);
  const auto at = [&](int64_t ns) { return micros(ns + clock_offset_ns - origin_ns); };

  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  list.push_back({{"name", "process_name"},
                  {"ph", "M"},
                  {"pid", rank},
                  {"tid", 0},
                  {"args", {{"name", "rank " + std::to_string(rank)}}}});
  list.push_back({{"name", "process_sort_index"},
                  {"ph", "M"},
                  {"pid", rank},
                  {"tid", 0},
                  {"args", {{"sort_index", rank}}}});
  const auto on_device = [&](const TraceEvent& e) {
    return e.device_begin >= 0 && e.device_end >= 0 &&
           static_cast<std::size_t>(e.device_end) < device_ns.size();
  };
  const bool device_track = std::any_of(events.begin(), events.end(), on_device);
  for (int tid = 0; tid < (device_track ? 2 : 1); ++tid) {
    list.push_back({{"name", "thread_name"},
                    {"ph", "M"},
                    {"pid", rank},
                    {"tid", tid},
                    {"args", {{"name", tid == 0 ? "host" : "device"}}}});
  }
  std::vector<const TraceEvent*> device_order;
  for (const TraceEvent* e : order) {
    nlohmann::ordered_json args = nlohmann::ordered_json::object();
    switch (e->kind) {
      case TraceKind::step:
        args["step"] = e->number;
        break;
      case TraceKind::gemm:
        args["m"] = e->m;
        args["n"] = e->n;
        args["k"] = e->k;
        args["dtype"] = e->detail;
        break;
      case TraceKind::collective:
      case TraceKind::wait:
        args["group"] = e->group;
        args["bytes"] = e->bytes;
        args["operand_bytes"] = e->operand_bytes;
        args["detail"] = e->detail;
        if (e->flow != 0) args["operation"] = e->flow;
        break;
      case TraceKind::layer:
        args["pass"] = e->detail;
        break;
      case TraceKind::phase:
        break;
    }
    list.push_back({{"name", e->name},
                    {"cat", to_string(e->kind)},
                    {"ph", "X"},
                    {"ts", at(e->begin_ns)},
                    {"dur", micros(e->end_ns - e->begin_ns)},
                    {"pid", rank},
                    {"tid", 0},
                    {"args", args}});
    if (on_device(*e)) device_order.push_back(e);
    // A flow arrow from a non-blocking operation's start to its wait (bound to the
    // enclosing slices: "s" at the start's end, "f" at the wait's start).
    if (e->flow != 0) {
      const bool start = e->kind == TraceKind::collective;
      nlohmann::ordered_json flow = {{"name", "operation"},
                                     {"cat", "flow"},
                                     {"ph", start ? "s" : "f"},
                                     {"id", e->flow},
                                     {"ts", at(start ? e->end_ns - 1 : e->begin_ns)},
                                     {"pid", rank},
                                     {"tid", 0}};
      if (!start) flow["bp"] = "e";
      list.push_back(std::move(flow));
    }
  }
  // The device track: the same spans at the device's times, in the order the device ran
  // them (markers on one queue: nested as on the host).
  std::stable_sort(device_order.begin(), device_order.end(),
                   [&](const TraceEvent* a, const TraceEvent* b) {
                     return device_ns[a->device_begin] < device_ns[b->device_begin];
                   });
  for (const TraceEvent* e : device_order) {
    nlohmann::ordered_json args = {{"kind", to_string(e->kind)}};
    if (e->kind == TraceKind::step) args["step"] = e->number;
    if (e->kind == TraceKind::gemm) {
      args["m"] = e->m;
      args["n"] = e->n;
      args["k"] = e->k;
    }
    const int64_t begin = device_ns[e->device_begin], end = device_ns[e->device_end];
    list.push_back({{"name", e->name},
                    {"cat", "device"},
                    {"ph", "X"},
                    {"ts", at(begin)},
                    {"dur", micros(end - begin)},
                    {"pid", rank},
                    {"tid", 1},
                    {"args", std::move(args)}});
  }
  // The background threads' lanes, a thread each.
  for (std::size_t l = 0; l < lanes.size(); ++l) {
    const int tid = static_cast<int>(2 + l);
    list.push_back({{"name", "thread_name"},
                    {"ph", "M"},
                    {"pid", rank},
                    {"tid", tid},
                    {"args", {{"name", lanes[l].name}}}});
    std::vector<const TraceEvent*> lane_order;
    for (const TraceEvent& e : lanes[l].events) lane_order.push_back(&e);
    std::stable_sort(lane_order.begin(), lane_order.end(), starts_first);
    for (const TraceEvent* e : lane_order) {
      nlohmann::ordered_json args = {{"kind", to_string(e->kind)}};
      if (e->bytes != 0) args["bytes"] = e->bytes;
      list.push_back({{"name", e->name},
                      {"cat", "background"},
                      {"ph", "X"},
                      {"ts", at(e->begin_ns)},
                      {"dur", micros(e->end_ns - e->begin_ns)},
                      {"pid", rank},
                      {"tid", tid},
                      {"args", std::move(args)}});
    }
    dropped += lanes[l].dropped;
  }
  nlohmann::ordered_json doc = {
      {"traceEvents", std::move(list)},
      {"displayTimeUnit", "ms"},
      {"otherData",
       {{"rank", rank}, {"ranks", ranks}, {"origin_ns", origin_ns}, {"dropped_events", dropped}}}};
  write_trace_file(path, doc.dump() + '\n');
}

void merge_chrome_traces(const std::vector<std::string>& paths, const std::string& merged) {
  nlohmann::ordered_json all = nlohmann::ordered_json::array();
  int64_t dropped = 0;
  for (const std::string& path : paths) {
    std::ifstream in(path);
    if (!in) MESHTRAIN_FAIL("cannot read the trace '", path, "'");
    nlohmann::ordered_json doc;
    try {
      doc = nlohmann::ordered_json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      MESHTRAIN_FAIL("the trace '", path, "' is not JSON: ", e.what());
    }
    for (auto& event : doc.at("traceEvents")) all.push_back(std::move(event));
    dropped += doc["otherData"].value("dropped_events", int64_t{0});
  }
  nlohmann::ordered_json doc = {
      {"traceEvents", std::move(all)},
      {"displayTimeUnit", "ms"},
      {"otherData", {{"ranks", paths.size()}, {"dropped_events", dropped}}}};
  write_trace_file(merged, doc.dump() + '\n');
}

void write_trace_file(const std::string& path, const std::string& text) {
  const std::string temp = path + ".tmp";
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    if (out) out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.close();
    if (!out) {
      std::remove(temp.c_str());
      MESHTRAIN_FAIL("cannot write the trace '", path, "' (through '", temp, "')");
    }
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    std::remove(temp.c_str());
    MESHTRAIN_FAIL("cannot rename '", temp, "' to '", path, "': ", std::strerror(error));
  }
}

void remove_trace_files(const std::string& trace_dir) {
  namespace fs = std::filesystem;
  static const std::regex written(
      R"((rank-[0-9]+|all-ranks|passes)\.json(\.tmp)?|config\.toml(\.tmp)?)");
  std::error_code error;
  fs::directory_iterator entries(trace_dir, error);
  if (error) return;
  std::vector<fs::path> doomed;
  for (const fs::directory_entry& entry : entries) {
    if (std::regex_match(entry.path().filename().string(), written)) doomed.push_back(entry.path());
  }
  for (const fs::path& path : doomed) fs::remove(path, error);
}

}  // namespace meshtrain
