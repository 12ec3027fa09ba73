// Headless Chromium trains in the page: node drive.mjs URL EP STEPS [chromium path]; prints the run as JSON.
import { chromium } from 'playwright-core';

const [url, ep, steps, exe = '/usr/bin/chromium'] = process.argv.slice(2);
const browser = await chromium.launch({ executablePath: exe, args: ['--enable-unsafe-webgpu', '--no-sandbox'] });
try {
  const page = await browser.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  await page.goto(url);
  await page.waitForFunction(() => window.bridgeReady === true, null, { timeout: 60000 });
  const result = await page.evaluate(async ([e, n]) => {
    try { return await window.bridgeRun(e, n); } catch (err) { return { error: String(err) }; }
  }, [ep, Number(steps)]);
  if (errors.length) result.pageErrors = errors;
  console.log(JSON.stringify(result));
} finally {
  await browser.close();
}
