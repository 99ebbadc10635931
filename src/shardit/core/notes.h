#pragma once
// Notes: where the library does not take a request exactly as given (a prompt truncated to
// max_length, text that is not UTF-8, a size rounded down, a guidance scale without effect) it
// says so. A command-line run reads them on stderr; a server gives them to the client whose
// request caused them (the answer's "warnings"), so it collects the notes of the thread that
// runs the request instead.
#include <string>
#include <vector>

namespace shardit {

/// Emits `text` (without the "note: " prefix or a newline): to this thread's innermost
/// NoteCollector when one is alive, otherwise to stderr as "note: <text>".
void note(const std::string& text);

/// Takes every note this thread emits while it lives (nested collectors: the innermost).
class NoteCollector {
 public:
  NoteCollector();
  ~NoteCollector();
  NoteCollector(const NoteCollector&) = delete;
  NoteCollector& operator=(const NoteCollector&) = delete;
  /// The notes so far, in order, each once (a note repeated for every prompt of a batch is one).
  const std::vector<std::string>& notes() const { return notes_; }

 private:
  friend void note(const std::string& text);
  NoteCollector* outer_;
  std::vector<std::string> notes_;
};

}  // namespace shardit
