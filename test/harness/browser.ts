/**
 * A real browser for tests of what users see: Debian's chromium, headless, driven by
 * puppeteer-core (installed by `scripts/browser`; `MAGUS_CHROMIUM` names another binary).
 * Pages are read as text over all their frames (the Temporal UI renders Markdown in iframes),
 * and every page a test looks at is kept as a screenshot under `test-results/ui/`.
 */
import { execFileSync } from 'node:child_process';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import puppeteer, { type Browser, type Page } from 'puppeteer-core';
import { REPO_ROOT } from './dev';
import { sleep } from './wait';

export const SCREENSHOTS = join(REPO_ROOT, 'test-results', 'ui');
const BLANK_RELOAD_MS = 10_000;

function chromium(): string {
  if (process.env.MAGUS_CHROMIUM) return process.env.MAGUS_CHROMIUM;
  try {
    return execFileSync('sh', ['-c', 'command -v chromium || command -v chromium-browser'], { encoding: 'utf8' }).trim().split('\n')[0]!;
  } catch {
    throw new Error('no chromium on the PATH: run scripts/browser (it installs Debian’s chromium), or set MAGUS_CHROMIUM');
  }
}

export interface UiBrowser {
  /**
   * Opens `url`, waits until every frame's text matches `expected` — each of them, when several:
   * the UI renders a page's parts as their data arrives — (or `timeoutMs`), screenshots it as
   * `<name>.png`, returns the text.
   */
  look(name: string, url: string, expected: RegExp | readonly RegExp[], timeoutMs?: number): Promise<string>;
  /** The same for a tab (e.g. `user-metadata`) of a workflow's page, found by its id as a user would (the UI picks the latest run). */
  lookAtWorkflow(name: string, ui: string, workflowId: string, tab: string, expected: RegExp | readonly RegExp[], timeoutMs?: number): Promise<string>;
  close(): Promise<void>;
}

export async function openBrowser(): Promise<UiBrowser> {
  mkdirSync(SCREENSHOTS, { recursive: true });
  // --no-sandbox: CI runs as root, where chromium's sandbox refuses to start.
  const browser: Browser = await puppeteer.launch({ executablePath: chromium(), headless: true, args: ['--no-sandbox', '--disable-dev-shm-usage'] });
  const page: Page = await browser.newPage();
  await page.setViewport({ width: 1600, height: 1000 });
  const text = async (): Promise<string> => {
    const parts = await Promise.all(page.frames().map((f) => (f.evaluate('document.body ? document.body.innerText : ""') as Promise<string>).catch(() => '')));
    return parts.join('\n');
  };
  const ui: UiBrowser = {
    async look(name, url, expected, timeoutMs = 30_000) {
      // The UI keeps long polls open: wait for the DOM, then for the text. A page still blank
      // after BLANK_RELOAD_MS (the UI's scripts never ran: seen once in CI, the machine busy, a
      // list that showed nothing for 30 s) is loaded again.
      const load = async () => {
        await page.goto(url, { waitUntil: 'domcontentloaded', timeout: timeoutMs });
        return Date.now();
      };
      let loadedAt = await load();
      const deadline = Date.now() + timeoutMs;
      const wanted: readonly RegExp[] = expected instanceof RegExp ? [expected] : expected;
      const missing = (t: string) => wanted.filter((r) => !r.test(t));
      let seen = await text();
      while (missing(seen).length > 0) {
        if (Date.now() > deadline) {
          await page.screenshot({ path: join(SCREENSHOTS, `${name}.failed.png`) });
          throw new Error(
            `${url} never showed ${missing(seen).map(String).join(' and ')}; it showed:\n${seen.slice(0, 3000) || '(a blank page, loaded again every 10 s)'}`,
          );
        }
        await sleep(500);
        if (seen.trim() === '' && Date.now() - loadedAt > BLANK_RELOAD_MS) loadedAt = await load();
        seen = await text();
      }
      await page.screenshot({ path: join(SCREENSHOTS, `${name}.png`) });
      return seen;
    },
    async lookAtWorkflow(name, base, workflowId, tab, expected, timeoutMs = 30_000) {
      const url = `${base}/namespaces/default/workflows/${encodeURIComponent(workflowId)}`;
      // The UI redirects to the latest run's page on a tab of its own choosing (UI 2.54 picks
      // `timeline`): the run id is what is waited for; then the tab asked for is opened. A load
      // that never redirects (seen once in CI, the machine busy) is loaded once more.
      const redirected = async (ms: number): Promise<boolean> => {
        await page.goto(url, { waitUntil: 'domcontentloaded', timeout: timeoutMs });
        return page.waitForFunction('/\\/[0-9a-f-]{36}\\/[a-z-]+$/.test(location.pathname)', { timeout: ms }).then(
          () => true,
          () => false,
        );
      };
      if (!(await redirected(timeoutMs)) && !(await redirected(timeoutMs))) {
        await page.screenshot({ path: join(SCREENSHOTS, `${name}.failed.png`) });
        throw new Error(`${url} never redirected to its run's page (twice, ${timeoutMs} ms each); it showed:\n${(await text()).slice(0, 3000)}`);
      }
      return ui.look(name, page.url().replace(/\/[a-z-]+$/, `/${tab}`), expected, timeoutMs);
    },
    close: () => browser.close(),
  };
  return ui;
}
