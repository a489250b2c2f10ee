#pragma once
// What a C handle of stream.h holds: the producer (stream_c.cpp) and, for the C LiveModel
// (run/live_model_c.cpp), the same producer. Internal: not installed for C callers.

#include <string>

#include "framework/stream/producer.hpp"
#include "stream.h"

struct mt_stream {
  meshtrain::StreamProducer producer;
  int dtype = MT_STREAM_FLOAT32;
  std::string error;
};
