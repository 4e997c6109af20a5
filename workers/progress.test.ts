import { TerminalProgress, type ProgressState } from './progress';

/** A terminal of `columns` columns that keeps what is written to it. */
function terminal(columns: number | undefined, isTTY = true): NodeJS.WriteStream & { written: string[] } {
  const written: string[] = [];
  return { isTTY, columns, written, write: (s: string) => written.push(s) > 0 } as unknown as NodeJS.WriteStream & { written: string[] };
}

const converting: ProgressState = {
  itemsDone: 45,
  itemsTotal: 90,
  itemLabel: 'tensors',
  label: 'gguf:q80 (2/2)',
  fraction: 0.75,
  current: 'model.layers.11.self_attn.q_proj.weight',
};
const transferring: ProgressState = {
  bytesDone: 1_500_000_000,
  bytesTotal: 2_200_000_000,
  itemsDone: 3,
  itemsTotal: 7,
  itemLabel: 'files',
  current: 'model-00004-of-00007.safetensors',
};

describe.each([40, 80, 200])('at %i columns', (columns) => {
  it.each([
    ['a conversion', converting],
    ['a transfer', transferring],
  ])('%s fits the line and cuts no field', (_what, state) => {
    const start = Date.now() - 30_000;
    jest.spyOn(Date, 'now').mockReturnValue(start);
    const bar = new TerminalProgress(terminal(columns));
    const all = new TerminalProgress(terminal(undefined, false));
    jest.spyOn(Date, 'now').mockRestore();
    const line = bar.render(state, start + 30_000, columns);
    const full = all.render(state, start + 30_000);
    expect(line.length).toBeLessThanOrEqual(columns - 1);
    // Every word of the fitted line is a word of the full one (whole fields dropped, none cut),
    // apart from the bar itself.
    const words = new Set(full.split(/\s+/));
    for (const w of line.replace(/^\[[#-]+\] /, '').split(/\s+/)) expect(words).toContain(w);
    expect(line).toContain('%');
    if (columns >= 80) expect(line).toMatch(/ETA \d+:\d\d/);
    if (columns >= 200) expect(line).toContain(state.current);
  });
});

it('redraws within the terminal width it is given, clearing what a longer line left', () => {
  const out = terminal(40);
  const bar = new TerminalProgress(out);
  bar.update({ ...converting, fraction: 1, itemsDone: 90 });
  const drawn = out.written.at(-1)!;
  expect(drawn.startsWith('\r')).toBe(true);
  expect(drawn.endsWith('\x1b[K')).toBe(true);
  expect(drawn.slice(1, -3).length).toBeLessThanOrEqual(39);
});

it('counts tensors as tensors: no bytes, no B/s', () => {
  const line = new TerminalProgress(terminal(200)).render({ itemsDone: 90, itemsTotal: 90, itemLabel: 'tensors' }, Date.now() + 10_000, 200);
  expect(line).toContain('90/90 tensors');
  expect(line).toMatch(/tensors\/s/);
  expect(line).not.toMatch(/\bB\b|B\/s/);
});

it('never goes back within one bar; a finished bar starts the next from its own start', () => {
  const bar = new TerminalProgress(terminal(120));
  const now = Date.now() + 1000;
  expect(bar.render({ ...converting, fraction: 0.5 }, now)).toContain(' 50.0%');
  expect(bar.render({ ...converting, fraction: 0.497 }, now)).toContain(' 50.0%');
  bar.finish();
  expect(bar.render({ ...converting, fraction: 0.1 }, now)).toContain(' 10.0%');
});
