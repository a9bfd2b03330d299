// Drives Ember's page in headless Chromium (playwright-core), for tests/browser/test_ui.py.
// argv: URL API_KEY OUT_DIR; env EMBER_NODE_MODULES (holds playwright-core), EMBER_CHROMIUM.
// Prints one JSON line of what it saw; the pytest side asserts on it.
import { createRequire } from "node:module";
import { join } from "node:path";

const [url, key, out] = process.argv.slice(2);
const require = createRequire(join(process.env.EMBER_NODE_MODULES, "noop.js"));
const { chromium } = require("playwright-core");

const seen = { console_errors: [], page_errors: [], requests_elsewhere: [] };
// launch() starts Chromium on a fresh temporary user-data-dir of its own, removed on close
const browser = await chromium.launch({
  executablePath: process.env.EMBER_CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run"],
});
const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
try {
  const page = await context.newPage();
  page.on("console", (m) => { if (m.type() === "error") seen.console_errors.push(m.text()); });
  page.on("pageerror", (e) => seen.page_errors.push(String(e)));
  page.on("request", (r) => { if (!r.url().startsWith(url)) seen.requests_elsewhere.push(r.url()); });
  const T = { timeout: 60000 };

  // 1. the page loads and, the server wanting a key, asks for it before any API call
  await page.goto(url + "/");
  await page.locator("#key-form").waitFor({ state: "visible", ...T });
  seen.errors_at_load = seen.console_errors.length + seen.page_errors.length;
  await page.fill("#key-input", key);
  await page.click("#key-form button[type=submit]");
  await page.locator("#conn.ok").waitFor(T);
  const served = page.locator('[data-testid=finished] .v');
  await served.waitFor(T);
  seen.served_before = await served.textContent();

  // 2. a chat streams: the answer's text grows in several steps before its usage line
  await page.click("#tab-playground");
  await page.locator("#model-select option").first().waitFor({ state: "attached", ...T });
  seen.models = await page.locator("#model-select option").allTextContents();
  await page.evaluate(() => {
    window.__lengths = [];
    new MutationObserver(() => {
      const c = document.querySelector("[data-testid=answer] [data-testid=content]");
      if (c && !document.querySelector("[data-testid=usage]")) window.__lengths.push(c.textContent.length);
    }).observe(document.getElementById("chat"), { childList: true, subtree: true, characterData: true });
  });
  await page.fill("#max-tokens", "48");
  await page.fill("#prompt", "Write a short Python function that adds two numbers, and explain it.");
  await page.click("#send");
  await page.locator("[data-testid=usage]").first().waitFor(T);
  seen.stream_lengths = [...new Set(await page.evaluate(() => window.__lengths))];
  seen.answer = await page.locator("[data-testid=answer] [data-testid=content]").first().textContent();
  seen.cached_first = Number(await page.locator("[data-testid=cached]").first().getAttribute("data-cached"));

  // 3. the replay of that request hits the prompt cache
  await page.locator("#replay:not([disabled])").waitFor(T);
  await page.click("#replay");
  await page.locator("[data-testid=usage]").nth(1).waitFor(T);
  seen.cached_replay = Number(await page.locator("[data-testid=cached]").nth(1).getAttribute("data-cached"));
  seen.replay_usage = await page.locator("[data-testid=usage]").nth(1).textContent();
  await page.screenshot({ path: join(out, "playground.png") });

  // 4. the dashboard's counters moved
  await page.click("#tab-dashboard");
  await page.waitForFunction(() => {  // the chat and its replay: two requests served
    const v = document.querySelector("[data-testid=finished] .v");
    return v && Number(v.textContent) >= 2;
  }, null, T);
  seen.served_after = await served.textContent();
  seen.ttft_bars = await page.locator("[data-testid=ttft] .spark span").count();
  seen.cache_columns = await page.locator("[data-testid=cache-share] .stack .col").count();
  await page.waitForTimeout(1500); // a rate needs two samples
  seen.decode = await page.locator("[data-testid=decode] .v").textContent();
  await page.screenshot({ path: join(out, "dashboard.png"), fullPage: true });

  // 4b. a hub pull under way shows from /health (faked here: tiny needs no download; a 200,
  // as Chromium logs a 503 fetch as a console error and the check below counts those)
  const pull = { model: "org/fake-model", done_bytes: 3 * 1048576, total_bytes: 12 * 1048576 };
  await page.route("**/health", (r) => r.fulfill({ status: 200, contentType: "application/json", body: JSON.stringify({ status: "ok", pulls: [pull] }) }));
  await page.locator("#pulls .pull").waitFor(T);
  seen.pull_text = await page.locator("#pulls").textContent();
  await page.unroute("**/health");
  await page.locator("#pulls").waitFor({ state: "hidden", ...T }); // gone once /health lists none
  seen.errors_before_wrong_key = [...seen.console_errors, ...seen.page_errors];

  // 5. a wrong key is refused
  await page.click("#key-button");
  await page.fill("#key-input", key + "-wrong");
  await page.click("#key-form button[type=submit]");
  // the next poll is refused and the key bar comes back, pushing the page
  // down; waiting for it keeps that layout shift out of the clicks below
  await page.locator("#key-form").waitFor({ state: "visible", ...T });
  seen.asked_again = await page.locator("#key-form label").textContent();
  await page.click("#tab-playground");
  await page.fill("#prompt", "Hello?");
  // a poll refused while the user types keeps the prompt's focus and text
  // (it once moved focus to the key field, and the typing with it)
  await page.evaluate(() => poll());
  seen.typing_kept = await page.evaluate(() => [document.activeElement.id, document.getElementById("prompt").value]);
  await page.click("#send");
  const refused = page.locator("[data-testid=chat-error]");
  try {
    await refused.waitFor(T);
  } catch (e) {  // say what the page showed instead: a CI log is all there is
    const state = await page.evaluate(() => ({
      chat: document.getElementById("chat").innerText.slice(-600),
      prompt: document.getElementById("prompt").value,
      send_disabled: document.getElementById("send").disabled,
      key_form_hidden: document.getElementById("key-form").hidden,
      focused: document.activeElement && document.activeElement.id,
    }));
    await page.screenshot({ path: join(out, "refused-timeout.png"), fullPage: true });
    throw new Error(`no refusal shown: ${JSON.stringify(state)}\n${e.message}`);
  }
  seen.refused = await refused.textContent();
} finally {
  await browser.close();
}
console.log(JSON.stringify(seen));
