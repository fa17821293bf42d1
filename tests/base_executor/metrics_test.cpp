// [Metrics]: the executor's Prometheus endpoint counts what its clients sent, tenant by tenant and
// layer by layer, errors by code included, and `symbiosis-ctl top` shows the same.
#include <gtest/gtest.h>
#include <httplib.h>

#include <cstdio>
#include <map>
#include <sstream>

#include "base_executor/executor.h"
#include "client_runtime/client.h"
#include "tests/test_util.h"

namespace symbiosis {
namespace {

using testing::relative_error;

// One scrape: each sample's value by its name and labels as written (`tenant="alice"`).
std::map<std::string, double> scrape(const std::string& url) {
  const auto path_at = url.find('/', std::string("http://").size());
  httplib::Client http(url.substr(0, path_at));
  auto answer = http.Get(url.substr(path_at));
  EXPECT_TRUE(answer) << "no answer from " << url;
  if (!answer) return {};
  EXPECT_EQ(answer->status, 200);
  EXPECT_NE(answer->get_header_value("Content-Type").find("text/plain; version=0.0.4"), std::string::npos);
  std::map<std::string, double> samples;
  std::istringstream lines(answer->body);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    const auto space = line.rfind(' ');
    samples[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return samples;
}

// What a shell command printed on stdout.
std::string output_of(const std::string& command) {
  std::string output;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return output;
  char buffer[4096];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) output.append(buffer, n);
  ::pclose(pipe);
  return output;
}

class MetricsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    checkpoint_ = new testing::TwoLayerCheckpoint(testing::write_two_layer_checkpoint("metrics-test", 3, false));
  }
  void SetUp() override {
    ExecutorOptions options;
    options.metrics_listen = "127.0.0.1:0";
    executor_ = testing::start_executor(checkpoint_->dir, options);
    ASSERT_EQ(executor_->metrics_url().rfind("http://127.0.0.1:", 0), 0u) << executor_->metrics_url();
  }
  std::shared_ptr<Client> connect(const std::string& tenant, const std::string& transport) {
    ClientOptions options;
    options.tenant = tenant;
    options.transport = transport;
    options.timeout_ms = 10000;
    return testing::connect(*executor_, options);
  }
  static testing::TwoLayerCheckpoint* checkpoint_;
  std::unique_ptr<Executor> executor_;
};

testing::TwoLayerCheckpoint* MetricsTest::checkpoint_ = nullptr;

TEST_F(MetricsTest, ScrapedCountsEqualWhatEachTenantSentAndBadRequestsShowUnderTheirCode) {
  const std::string up = "model.layers.0.mlp.up_proj", q = "model.layers.0.self_attn.q_proj";
  // alice (tcp): 5 forwards of 3 tokens and 2 backwards of 3 tokens through up_proj; bob (shm): 4
  // forwards of 7 tokens through q_proj and one call of a layer the executor does not serve.
  auto alice = connect("alice", "tcp");
  auto bob = connect("bob", "shm");
  for (int i = 0; i < 5; ++i) {
    auto x = at::randn({3, 4});
    auto y = alice->forward(*alice->find_layer(up), x, true);
    EXPECT_LT(relative_error(y, at::addmm(checkpoint_->up_bias, x, checkpoint_->up_weight.t())), 1e-6);
  }
  for (int i = 0; i < 2; ++i) alice->backward_input(*alice->find_layer(up), at::randn({3, 6}));
  for (int i = 0; i < 4; ++i) {
    auto x = at::randn({7, 4});
    EXPECT_LT(relative_error(bob->forward(*bob->find_layer(q), x, false), at::mm(x, checkpoint_->q.t())), 1e-6);
  }
  LayerInfo unserved = *bob->find_layer(q);
  unserved.id = 42;
  EXPECT_NE(testing::error_of([&] {
              bob->forward(unserved, at::randn({2, 4}), false);
            }).find("NOT_FOUND"),
            std::string::npos);

  // A batch is counted just after its replies went out: the last one may still be on its way.
  std::map<std::string, double> m;
  testing::wait_until(
      [&] {
        m = scrape(executor_->metrics_url());
        return m["symbiosis_requests_total"] >= 11;
      },
      std::chrono::seconds(5));
  EXPECT_EQ(m["symbiosis_tenant_requests_total{tenant=\"alice\"}"], 7);
  EXPECT_EQ(m["symbiosis_tenant_tokens_total{tenant=\"alice\"}"], 21);
  EXPECT_EQ(m["symbiosis_tenant_requests_total{tenant=\"bob\"}"], 4);
  EXPECT_EQ(m["symbiosis_tenant_tokens_total{tenant=\"bob\"}"], 28);
  EXPECT_EQ(m["symbiosis_tenant_errors_total{tenant=\"bob\",code=\"NOT_FOUND\"}"], 1);
  EXPECT_EQ(m.count("symbiosis_tenant_errors_total{tenant=\"alice\",code=\"NOT_FOUND\"}"), 0u);
  EXPECT_EQ(m["symbiosis_errors_total{code=\"NOT_FOUND\"}"], 1);
  EXPECT_EQ(m["symbiosis_errors_total{code=\"INVALID_ARGUMENT\"}"], 0);
  EXPECT_EQ(m["symbiosis_requests_total"], 11);
  EXPECT_EQ(m["symbiosis_tokens_total"], 49);
  EXPECT_EQ(m["symbiosis_layer_requests_total{layer=\"" + up + "\"}"], 7);
  EXPECT_EQ(m["symbiosis_layer_tokens_total{layer=\"" + up + "\"}"], 21);
  EXPECT_EQ(m["symbiosis_layer_requests_total{layer=\"" + q + "\"}"], 4);
  EXPECT_EQ(m["symbiosis_layer_batches_total{layer=\"" + up + "\",op=\"backward\"}"], 2);
  EXPECT_EQ(m["symbiosis_layer_batches_total{layer=\"" + q + "\",op=\"forward\"}"], 4);
  EXPECT_EQ(m["symbiosis_clients{transport=\"tcp\"}"], 1);
  EXPECT_EQ(m["symbiosis_clients{transport=\"shm\"}"], 1);
  EXPECT_EQ(m["symbiosis_class_requests_total{class=\"fine_tuning\"}"], 11);
  // Every call ran alone (one at a time): 11 batches of one call each.
  EXPECT_EQ(m["symbiosis_batch_requests_count"], 11);
  EXPECT_EQ(m["symbiosis_batch_requests_bucket{le=\"1\"}"], 11);
  EXPECT_EQ(m["symbiosis_batch_tokens_sum"], 49);
  EXPECT_EQ(m["symbiosis_wait_seconds_count"], 11);
  EXPECT_EQ(m["symbiosis_wait_seconds_bucket{le=\"+Inf\"}"], 11);
  EXPECT_GT(m["symbiosis_compute_seconds_total"], 0);
  EXPECT_GT(m["symbiosis_resident_bytes"], 1 << 20);
  EXPECT_GT(m["symbiosis_buffer_bytes"], 0);  // bob's control segment and payload buffer
  EXPECT_EQ(m["symbiosis_queued_tokens"], 0);

  // A client that leaves counts no more; its tenant's counts stay.
  bob.reset();
  ASSERT_TRUE(testing::same_host_clients_become(*executor_, 0));
  // Its buffers are given back on the scheduler's thread, just after the front door counted it gone
  // (a fresh-clone make test saw 4 MiB still held once).
  testing::wait_until(
      [&] {
        m = scrape(executor_->metrics_url());
        return m["symbiosis_buffer_bytes"] == 0;
      },
      std::chrono::seconds(5));
  EXPECT_EQ(m["symbiosis_clients{transport=\"shm\"}"], 0);
  EXPECT_EQ(m["symbiosis_tenant_requests_total{tenant=\"bob\"}"], 4);
  EXPECT_EQ(m["symbiosis_buffer_bytes"], 0);

  // `symbiosis-ctl top --once` shows the same per tenant: requests, req/s, tokens, tokens/s, errors.
  const auto top = output_of(testing::binary("tools/symbiosis-ctl") + " top --once --interval 0.1 --metrics " +
                             executor_->metrics_url());
  std::map<std::string, std::vector<std::string>> rows;
  std::istringstream lines(top);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream fields(line);
    std::vector<std::string> row;
    for (std::string field; fields >> field;) row.push_back(field);
    if (!row.empty()) rows[row[0]] = row;
  }
  ASSERT_EQ(rows["alice"].size(), 6u) << top;
  EXPECT_EQ(rows["alice"][1], "7") << top;
  EXPECT_EQ(rows["alice"][3], "21") << top;
  ASSERT_EQ(rows["bob"].size(), 6u) << top;
  EXPECT_EQ(rows["bob"][1], "4") << top;
  EXPECT_EQ(rows["bob"][5], "1") << top;  // its NOT_FOUND
  ASSERT_EQ(rows[up].size(), 8u) << top;
  EXPECT_EQ(rows[up][1], "7") << top;
  EXPECT_NE(top.find("NOT_FOUND 1"), std::string::npos) << top;
}

TEST_F(MetricsTest, TenantNamesAreEscapedAndAWrongAddressForTopIsAClearError) {
  auto odd = connect("quote\" back\\slash\nnewline", "tcp");
  auto x = at::randn({2, 4});
  odd->forward(*odd->find_layer("model.layers.0.mlp.up_proj"), x, true);
  // The batch is counted just after its reply went out (it failed once so under a full ctest run).
  const std::string odd_requests = "symbiosis_tenant_requests_total{tenant=\"quote\\\" back\\\\slash\\nnewline\"}";
  std::map<std::string, double> m;
  testing::wait_until(
      [&] {
        m = scrape(executor_->metrics_url());
        return m[odd_requests] >= 1;
      },
      std::chrono::seconds(5));
  EXPECT_EQ(m[odd_requests], 1);

  const auto ctl = testing::binary("tools/symbiosis-ctl");
  const auto no_scheme = output_of(ctl + " top --once --metrics 127.0.0.1:9 2>&1");
  EXPECT_NE(no_scheme.find("--metrics must be http://HOST:PORT"), std::string::npos) << no_scheme;
  const auto nobody = output_of(ctl + " top --once --metrics http://127.0.0.1:1 2>&1");
  EXPECT_NE(nobody.find("cannot read the metrics at http://127.0.0.1:1/metrics"), std::string::npos) << nobody;
}

}  // namespace
}  // namespace symbiosis
