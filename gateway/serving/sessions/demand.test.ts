/** Demand told to pools: at most once a second per model, refreshed while it lasts, 0 once nobody waits. */
import { readyModel } from '../../../test/harness/gateway-app';
import { Demand } from './demand';
import type { FirstTurns } from './types';

beforeEach(() => jest.useFakeTimers({ now: 1_000_000 }));
afterEach(() => jest.useRealTimers());

function demandOf() {
  const told: number[] = [];
  const first = { demand: (_model, waiting) => (told.push(waiting), Promise.resolve()) } as Pick<FirstTurns, 'demand'> as FirstTurns;
  return { demand: new Demand(first, Date.now), told };
}
const model = readyModel('tiny');

it('tells a change at once, then at most once a second; the last waiter leaving tells 0', () => {
  const { demand, told } = demandOf();
  const k = demand.wait(model);
  demand.tell(k);
  expect(told).toEqual([1]);
  demand.wait(model);
  demand.tell(k);
  expect(told).toEqual([1]);
  jest.advanceTimersByTime(1000);
  expect(told).toEqual([1, 2]);
  demand.leave(k);
  demand.leave(k);
  jest.advanceTimersByTime(1000);
  expect(told).toEqual([1, 2, 0]);
  jest.advanceTimersByTime(60_000);
  expect(told).toEqual([1, 2, 0]);
});

it('tells an unchanged demand again every 10 s while it lasts', () => {
  const { demand, told } = demandOf();
  const k = demand.wait(model);
  demand.tell(k);
  jest.advanceTimersByTime(5_000);
  demand.tell(k);
  expect(told).toEqual([1]);
  jest.advanceTimersByTime(5_000);
  demand.tell(k);
  expect(told).toEqual([1, 1]);
});

it('tells nothing once closed', () => {
  const { demand, told } = demandOf();
  const k = demand.wait(model);
  demand.tell(k);
  demand.wait(model);
  demand.tell(k);
  demand.close();
  jest.advanceTimersByTime(2_000);
  expect(told).toEqual([1]);
});
