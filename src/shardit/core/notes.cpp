#include "shardit/core/notes.h"

#include <algorithm>
#include <cstdio>

namespace shardit {

namespace {
thread_local NoteCollector* t_collector = nullptr;
}  // namespace

void note(const std::string& text) {
  if (t_collector == nullptr) {
    std::fprintf(stderr, "note: %s\n", text.c_str());
    return;
  }
  auto& notes = t_collector->notes_;
  if (std::find(notes.begin(), notes.end(), text) == notes.end()) notes.push_back(text);
}

NoteCollector::NoteCollector() : outer_(t_collector) { t_collector = this; }

NoteCollector::~NoteCollector() { t_collector = outer_; }

}  // namespace shardit
