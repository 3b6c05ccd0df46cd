// Runs one layer of a Caffe fork, built CPU-only, on blobs read from a file, and writes what it
// computes. Used to record golden data for sncaffe's tests of the forks' layers.
//
//   layer_driver LAYER.prototxt IN.bin OUT.bin
//
// IN.bin, all little-endian int32 counts and float32 values:
//   n_bottoms, then per bottom: ndim, dims..., values; then per bottom an int32 propagate_down flag
//   n_params, then per param blob: ndim, dims..., values  (0: keep the blobs the layer's fillers made)
//   n_top_diffs, then per top: ndim, dims..., values    (0: forward only, or loss weights for losses)
// OUT.bin: n_tops and the tops, n_bottoms and the bottom diffs, n_params and the params and their diffs,
//   each blob as ndim, dims..., values (a diff that was not computed is written as zeros).
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <google/protobuf/text_format.h>

#include "caffe/blob.hpp"
#include "caffe/common.hpp"
#include "caffe/layer.hpp"
#include "caffe/layer_factory.hpp"
#include "caffe/proto/caffe.pb.h"

#ifdef REGISTER_SOFTMAX
// BVLC's layer_factory.cpp registers Softmax through its engine switch; the CPU engine is this class.
#include "caffe/layers/softmax_layer.hpp"
namespace caffe { REGISTER_LAYER_CLASS(Softmax); }
#endif

using caffe::Blob;
using std::vector;

static int read_int(FILE* f) {
  int v;
  CHECK_EQ(fread(&v, 4, 1, f), 1u);
  return v;
}

static void read_blob(FILE* f, Blob<float>* blob, bool diff) {
  int ndim = read_int(f);
  vector<int> shape(ndim);
  for (int i = 0; i < ndim; ++i) shape[i] = read_int(f);
  if (!diff) blob->Reshape(shape);
  CHECK(blob->shape() == shape) << "shape mismatch for " << blob->shape_string();
  float* p = diff ? blob->mutable_cpu_diff() : blob->mutable_cpu_data();
  CHECK_EQ(fread(p, 4, blob->count(), f), static_cast<size_t>(blob->count()));
}

static void write_blob(FILE* f, const Blob<float>& blob, bool diff) {
  int ndim = blob.num_axes();
  fwrite(&ndim, 4, 1, f);
  for (int i = 0; i < ndim; ++i) { int d = blob.shape(i); fwrite(&d, 4, 1, f); }
  fwrite(diff ? blob.cpu_diff() : blob.cpu_data(), 4, blob.count(), f);
}

int main(int argc, char** argv) {
  google::InitGoogleLogging(argv[0]);
  CHECK_EQ(argc, 4) << "usage: layer_driver LAYER.prototxt IN.bin OUT.bin";
  caffe::Caffe::set_mode(caffe::Caffe::CPU);
  caffe::Caffe::set_random_seed(1701);
  caffe::LayerParameter param;
  {  // parsed here: the forks' util/io.cpp pulls in OpenCV
    std::ifstream text_file(argv[1]);
    std::string text((std::istreambuf_iterator<char>(text_file)), std::istreambuf_iterator<char>());
    CHECK(google::protobuf::TextFormat::ParseFromString(text, &param)) << argv[1];
  }
  FILE* in = fopen(argv[2], "rb");
  CHECK(in) << argv[2];
  int n_bottoms = read_int(in);
  vector<Blob<float>*> bottom, top;
  for (int i = 0; i < n_bottoms; ++i) {
    bottom.push_back(new Blob<float>());
    read_blob(in, bottom.back(), false);
  }
  vector<bool> propagate_down;
  for (int i = 0; i < n_bottoms; ++i) propagate_down.push_back(read_int(in) != 0);
  for (int i = 0; i < param.top_size(); ++i) top.push_back(new Blob<float>());
  boost::shared_ptr<caffe::Layer<float> > layer = caffe::LayerRegistry<float>::CreateLayer(param);
  layer->SetUp(bottom, top);
  int n_params = read_int(in);
  CHECK(n_params == 0 || n_params == static_cast<int>(layer->blobs().size()));
  for (int i = 0; i < n_params; ++i) read_blob(in, layer->blobs()[i].get(), false);
  layer->Forward(bottom, top);
  int n_top_diffs = read_int(in);
  for (int i = 0; i < n_top_diffs; ++i) read_blob(in, top[i], true);
  fclose(in);
  for (int i = 0; i < n_bottoms; ++i) caffe::caffe_set(bottom[i]->count(), 0.f, bottom[i]->mutable_cpu_diff());
  for (size_t i = 0; i < layer->blobs().size(); ++i) {
    caffe::caffe_set(layer->blobs()[i]->count(), 0.f, layer->blobs()[i]->mutable_cpu_diff());
  }
  bool backward = n_top_diffs > 0;
  for (int i = 0; i < param.top_size(); ++i) backward = backward || layer->loss(i) != 0;
  if (backward) layer->Backward(top, propagate_down, bottom);
  FILE* out = fopen(argv[3], "wb");
  CHECK(out) << argv[3];
  int n = top.size();
  fwrite(&n, 4, 1, out);
  for (int i = 0; i < n; ++i) write_blob(out, *top[i], false);
  fwrite(&n_bottoms, 4, 1, out);
  for (int i = 0; i < n_bottoms; ++i) write_blob(out, *bottom[i], true);
  n = layer->blobs().size();
  fwrite(&n, 4, 1, out);
  for (int i = 0; i < n; ++i) {
    write_blob(out, *layer->blobs()[i], false);
    write_blob(out, *layer->blobs()[i], true);
  }
  fclose(out);
  return 0;
}
