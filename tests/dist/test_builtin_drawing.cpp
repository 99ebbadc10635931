// The built-in pipeline draws what it is asked (tools/train_builtin_model.py trained it on the
// scenes of tools/builtin_scenes.py): for a few prompts, `shardit generate` without --model at
// TP=1, at TP=2, with --cache and with --weights-dtype int8 gives images in which the named colour
// covers a part of the picture, centred in the named region, in the named shape: its largest region's
// fill of its box and of its disc, and its share above its middle, fall where that shape's do and
// the other shapes' do not (docs/builtin_model.md). The thresholds come from the trained model's
// own images with a margin.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "shardit/io/png.h"
#include "support/test_support.h"

namespace test_builtin_drawing {

// The palette of tools/builtin_scenes.py (COLOURS, DEFAULT_BACKGROUND).
struct Colour {
  const char* name;
  std::array<int, 3> rgb;
};
constexpr std::array<Colour, 9> kPalette = {{{"red", {220, 30, 30}},
                                             {"green", {30, 170, 50}},
                                             {"blue", {30, 60, 220}},
                                             {"yellow", {245, 215, 30}},
                                             {"orange", {245, 130, 20}},
                                             {"purple", {140, 40, 180}},
                                             {"white", {250, 250, 250}},
                                             {"black", {15, 15, 15}},
                                             {"gray", {128, 128, 128}}}};

enum class Shape { kCircle, kSquare, kTriangle };

struct Drawing {
  std::string prompt;
  std::string colour;
  Shape shape;
  double cx, cy;         // the named region's centre (tools/builtin_scenes.py's POSITIONS), as fractions
  double min_fraction;   // the least share of the picture in the named colour
};

const std::vector<Drawing>& drawings() {
  static const std::vector<Drawing> list = {
      {"a large yellow circle at the bottom right", "yellow", Shape::kCircle, 0.78, 0.78, 0.07},
      {"a large white square at the bottom on a green background", "white", Shape::kSquare, 0.5, 0.78, 0.078},
      {"a large red triangle at the top left", "red", Shape::kTriangle, 0.22, 0.22, 0.034},
      {"a large yellow triangle at the bottom right", "yellow", Shape::kTriangle, 0.78, 0.78, 0.026},
  };
  return list;
}

// What the test measures in one image: the fraction of pixels whose nearest palette colour is the
// named one and their centroid (fractions of the width and height); and the shape of the largest
// 4-connected region of them: how much of its bounding box (2nd to 98th percentile along each axis,
// so that stray pixels do not count) it fills, how much of its bounding disc (about its centroid,
// the 98th percentile of its pixels' distances), and which share of it lies above the middle of
// its box. A circle fills its disc, a square its box, a triangle (apex up) has most of itself below.
struct Measure {
  double fraction = 0, cx = 0, cy = 0;
  double box = 0, disc = 0, top = 0;
};

// The largest 4-connected region of `mask` ([H, W] bool) as [N, 2] (row, column) doubles.
at::Tensor largest_region(const at::Tensor& mask) {
  const int64_t h = mask.size(0), w = mask.size(1);
  const at::Tensor contiguous = mask.contiguous();
  const bool* in = contiguous.data_ptr<bool>();
  std::vector<int32_t> label(static_cast<size_t>(h * w), -1);
  std::vector<int64_t> best, region, stack;
  for (int64_t start = 0; start < h * w; ++start) {
    if (!in[start] || label[start] >= 0) continue;
    region.clear();
    stack.assign(1, start);
    label[start] = 1;
    while (!stack.empty()) {
      const int64_t at_index = stack.back();
      stack.pop_back();
      region.push_back(at_index);
      const int64_t y = at_index / w, x = at_index % w;
      const std::array<std::array<int64_t, 2>, 4> steps = {{{y - 1, x}, {y + 1, x}, {y, x - 1}, {y, x + 1}}};
      for (const auto& [ny, nx] : steps) {
        if (ny < 0 || ny >= h || nx < 0 || nx >= w) continue;
        const int64_t next = ny * w + nx;
        if (in[next] && label[next] < 0) {
          label[next] = 1;
          stack.push_back(next);
        }
      }
    }
    if (region.size() > best.size()) best.swap(region);
  }
  at::Tensor out = at::empty({static_cast<int64_t>(best.size()), 2}, at::kDouble);
  auto rows = out.accessor<double, 2>();
  for (size_t i = 0; i < best.size(); ++i) {
    rows[static_cast<int64_t>(i)][0] = static_cast<double>(best[i] / w);
    rows[static_cast<int64_t>(i)][1] = static_cast<double>(best[i] % w);
  }
  return out;
}

Measure measure(const at::Tensor& png, const std::string& colour) {
  const at::Tensor pixels = png.to(at::kFloat);  // [H, W, 3]
  std::vector<at::Tensor> distances;
  int64_t named = -1;
  for (size_t i = 0; i < kPalette.size(); ++i) {
    const at::Tensor rgb = at::tensor({kPalette[i].rgb[0], kPalette[i].rgb[1], kPalette[i].rgb[2]}, at::kFloat);
    distances.push_back((pixels - rgb).pow(2).sum(-1));
    if (colour == kPalette[i].name) named = static_cast<int64_t>(i);
  }
  EXPECT_GE(named, 0) << colour;
  const at::Tensor mask = at::stack(distances).argmin(0).eq(named);
  Measure out;
  const int64_t h = png.size(0), w = png.size(1);
  const int64_t count = mask.sum().item<int64_t>();
  out.fraction = static_cast<double>(count) / static_cast<double>(h * w);
  if (count < 16) return out;
  const at::Tensor where = mask.nonzero().to(at::kDouble);  // [N, 2] rows, cols
  out.cy = (where.select(1, 0).mean().item<double>() + 0.5) / static_cast<double>(h);
  out.cx = (where.select(1, 1).mean().item<double>() + 0.5) / static_cast<double>(w);
  const at::Tensor region = largest_region(mask);  // [M, 2] rows, cols
  const double region_pixels = static_cast<double>(region.size(0));
  if (region_pixels < 16) return out;
  const at::Tensor percentiles = at::tensor({0.02, 0.98}, at::kDouble);
  const at::Tensor low_high = at::quantile(region, percentiles, /*dim=*/0);  // [2, 2]: (2nd, 98th) x (row, col)
  const at::Tensor extent = low_high[1] - low_high[0] + 1.0;
  out.box = region_pixels / (extent[0].item<double>() * extent[1].item<double>());
  const at::Tensor centre = region.mean(0);
  const double radius = at::quantile((region - centre).norm(2, 1), 0.98).item<double>() + 0.5;
  out.disc = region_pixels / (M_PI * radius * radius);
  const double middle = (low_high[0][0].item<double>() + low_high[1][0].item<double>()) / 2;
  out.top = region.select(1, 0).lt(middle).to(at::kDouble).mean().item<double>();
  return out;
}

// The measures of each shape as tools/builtin_scenes.py draws it (medians over the scenes of the
// descriptor measure in docs/builtin_model.md): a circle fills its disc, a square its box, a
// triangle (apex up) has most of itself below the middle of its box.
struct ShapeMeasures {
  Shape shape;
  const char* name;
  double box, disc, top;
};
constexpr std::array<ShapeMeasures, 3> kDrawnShapes = {{{Shape::kCircle, "circle", 0.93, 0.98, 0.50},
                                                        {Shape::kSquare, "square", 1.00, 0.76, 0.50},
                                                        {Shape::kTriangle, "triangle", 0.70, 0.52, 0.32}}};

// The drawn shape whose measures are nearest to `m`'s (Euclidean over box, disc and top), and how
// much nearer than the next: the picture shows the shape it is nearest to.
std::pair<const ShapeMeasures*, double> nearest_shape(const Measure& m) {
  std::vector<std::pair<double, const ShapeMeasures*>> distances;
  for (const ShapeMeasures& drawn : kDrawnShapes) {
    distances.emplace_back(std::hypot(m.box - drawn.box, m.disc - drawn.disc, m.top - drawn.top), &drawn);
  }
  std::sort(distances.begin(), distances.end());
  return {distances[0].second, distances[1].first / std::max(distances[0].first, 1e-9)};
}

// One `shardit generate` of every prompt (a batch) on the built-in model, with `launch` before the
// command (--nproc-per-node) and `options` after it: the PNGs. The built-in folder is written
// under `dir` (TMPDIR), once, by the first run.
std::vector<at::Tensor> generate(const std::string& dir, const std::string& name, const std::string& launch,
                                 const std::string& options) {
  std::string command = "TMPDIR=" + dir + " " + shardit::testing::cli_path() + " " + launch + " generate " + options;
  for (const Drawing& d : drawings()) command += " --prompt '" + d.prompt + "'";
  command += " --max-sequence-length 32 --height 128 --width 128 --steps 8 --seed 42 --out " + dir + "/" + name +
             ".png";
  std::string output;
  EXPECT_EQ(shardit::testing::run_command(command, &output), 0) << output;
  std::vector<at::Tensor> images;
  for (size_t i = 0; i < drawings().size(); ++i) {
    images.push_back(shardit::io::read_png(dir + "/" + name + "_" + std::to_string(i) + ".png").to(at::kInt));
  }
  return images;
}

// Thresholds from the trained model's images (all four runs below; docs/builtin_model.md) with a margin:
// the named colour covers at least half the share it covered there (Drawing::min_fraction), and its
// centroid lies within kMaxCentreDistance of the named region's centre (fractions of the side; the
// regions' centres are 0.28 apart, the measured centroids within 0.05 of theirs), so a shape in a
// neighbouring region fails. Its largest region's measures are nearest the named shape's, at least
// kMinShapeMargin times nearer than the next shape's (measured: 2.4 to 6.1 times).
constexpr double kMaxCentreDistance = 0.12;
constexpr double kMinShapeMargin = 1.5;

TEST(BuiltinDrawing, DrawsTheNamedShapeAndColourWhereAsked) {
  const std::string dir = shardit::testing::make_temp_dir("builtin-drawing");
  const std::vector<std::array<std::string, 3>> runs = {{"tp1", "", ""},
                                                        {"tp2", "--nproc-per-node 2", ""},
                                                        {"cache", "", "--cache first_block_cache:threshold=0.3"},
                                                        {"int8", "", "--weights-dtype int8"}};
  for (const auto& [name, launch, options] : runs) {
    const std::vector<at::Tensor> images = generate(dir, name, launch, options);
    for (size_t i = 0; i < drawings().size(); ++i) {
      const Drawing& d = drawings()[i];
      const Measure m = measure(images[i], d.colour);
      const std::string what = name + ": \"" + d.prompt + "\"";
      std::cout << what << ": fraction " << m.fraction << ", centroid (" << m.cx << ", " << m.cy << "), box "
                << m.box << ", disc " << m.disc << ", top " << m.top << "\n";
      EXPECT_GE(m.fraction, d.min_fraction) << what;
      EXPECT_LE(std::hypot(m.cx - d.cx, m.cy - d.cy), kMaxCentreDistance) << what;
      const auto [nearest, margin] = nearest_shape(m);
      std::cout << "  nearest shape " << nearest->name << ", " << margin << " times nearer than the next\n";
      EXPECT_TRUE(nearest->shape == d.shape) << what << ": drew a " << nearest->name;
      EXPECT_GE(margin, kMinShapeMargin) << what << ": the shape is not clearly a " << nearest->name;
    }
  }
}

}  // namespace test_builtin_drawing
